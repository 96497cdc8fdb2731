"""The disk tier: a third pool, files under a directory the user names, for chunks' fp32
masters and optimizer state.

[Note: the disk tier]
A chunk whose optimizer side is in the DISK pool keeps its gradient shard in host memory (the
reductions write it during backward) and its fp32 master and optimizer state in a file of its
own; in memory those tensors keep their identity and shape with their storage resized to
zero, as a released payload is (see [Note: the chunk owns its optimizer state] in
optimizer_state.py), so the optimizer's views and state dict stay valid. The step brings a
chunk's bytes in before it steps and sends them back after (see [Note: the disk tier in the
step] in engine/optimizer.py): reads run one chunk ahead and writes one behind, on a reader and
a writer thread, so the step's working set is three chunks' optimizer sides whatever the
model's size.

Nothing is lost when a read or write fails. Each chunk has two slot files: a write goes to the
slot not holding the last committed copy, and only `commit()` (called once every rank has
written every chunk of the step) makes it the current one, so a failed step leaves the
previous copy on disk to roll back to (the memory above the files is restored from it).

I/O is the standard library's: `os.preadv` / `os.pwritev` straight between the files and the
tensors' memory (no staging copy), run by `concurrent.futures` thread pools; both calls
release the GIL, so a read, a write and the fused optimizer kernel all run at once. DeepSpeed's
libaio op would need a C++ build against libaio-dev; kvikio (GPUDirect Storage) serves only
CUDA memory; `aiofiles` is an asyncio front for the same thread pool. Files go through the page
cache (no O_DIRECT, whose alignment rules the tensors' allocations do not meet).

The directory made for this rank's files is removed when the pool is closed (the optimizer
that made it is closed or collected) or the process exits.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

# os.preadv / pwritev take at most IOV_MAX buffers per call; Linux's is 1024.
_MAX_BUFFERS = 512


class DiskTierError(RuntimeError):
    """A read or write of the disk tier failed (raised on every rank alike by the step)."""


@dataclass(slots=True)
class _Copy:
    """One chunk's bytes in one slot file: the tensors, their sizes, and which slot."""

    slot: int
    nbytes: list[int]


class DiskPool:
    """Files under `directory` holding chunks' fp32 masters and optimizer state, two slots per
    chunk (see [Note: the disk tier]).

    Args:
        directory: where to make this rank's folder of files (created if missing).
        rank: the rank, named in the folder's name.
    """

    def __init__(self, directory: str | os.PathLike[str], *, rank: int) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"the disk tier's directory must be a path, got {directory!r}")
        base = Path(directory)
        try:
            base.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f"shardwise-rank{rank}-", dir=base))
        except OSError as error:
            raise ValueError(
                f"the disk tier's directory {str(base)!r} cannot hold files: {error}; name a "
                f"writable directory (nvme_offload_dir / offload_dir)"
            ) from None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="shardwise-disk-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="shardwise-disk-write")
        self._committed: dict[int, _Copy] = {}
        self._written: dict[int, _Copy] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self._finalizer = weakref.finalize(self, _remove, self.path, (self._reader, self._writer))

    # ---- what is where -----------------------------------------------------------------------

    def holds(self, key: int) -> bool:
        """Whether a committed copy of chunk `key` is on disk."""
        return key in self._committed

    def stored_bytes(self, key: int) -> int:
        """Bytes of chunk `key`'s committed copy (0 when there is none)."""
        copy = self._committed.get(key)
        return sum(copy.nbytes) if copy is not None else 0

    def total_bytes(self) -> int:
        """Bytes of every committed copy."""
        return sum(sum(copy.nbytes) for copy in self._committed.values())

    # ---- moves -------------------------------------------------------------------------------

    def write(self, key: int, tensors: Sequence[torch.Tensor]) -> Future[None]:
        """Write `tensors` (contiguous, in host memory) as chunk `key`'s next copy, in the
        background, then free their storage (resized to zero). Until `commit(key)`, the last
        committed copy stays the one `read` returns; a failed write leaves the tensors as they
        were (the future raises)."""
        copy = self._committed.get(key)
        slot = 0 if copy is None else 1 - copy.slot
        tensors = list(tensors)
        return self._writer.submit(self._write, key, slot, tensors)

    def read(self, key: int, tensors: Sequence[torch.Tensor]) -> Future[None]:
        """Give `tensors` their storage back and fill it from chunk `key`'s committed copy,
        in the background."""
        copy = self._committed.get(key)
        if copy is None:
            raise RuntimeError(f"chunk {key} has no copy on the disk tier to read")
        tensors = list(tensors)
        if [_nbytes(t) for t in tensors] != copy.nbytes:
            raise RuntimeError(
                f"chunk {key}: the tensors to read ({[_nbytes(t) for t in tensors]} bytes) are "
                f"not those written ({copy.nbytes})"
            )
        return self._reader.submit(self._read, key, copy, tensors)

    def commit(self, keys: Sequence[int]) -> None:
        """The copies written since the last commit of `keys` become the ones `read`
        returns."""
        with self._lock:
            for key in keys:
                written = self._written.pop(key, None)
                if written is not None:
                    self._committed[key] = written

    def discard(self, keys: Sequence[int]) -> None:
        """Forget what was written of `keys` since their last commit (a step rolled back)."""
        with self._lock:
            for key in keys:
                self._written.pop(key, None)

    def forget(self, key: int) -> None:
        """Chunk `key` left the disk tier: drop its copies."""
        with self._lock:
            self._committed.pop(key, None)
            self._written.pop(key, None)
        for slot in (0, 1):
            self._file(key, slot).unlink(missing_ok=True)

    def close(self) -> None:
        """Stop the threads and remove this rank's files."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    # ---- on the threads ----------------------------------------------------------------------

    def _file(self, key: int, slot: int) -> Path:
        return self.path / f"chunk{key}.{slot}"

    def _write(self, key: int, slot: int, tensors: list[torch.Tensor]) -> None:
        buffers = [_bytes_of(t) for t in tensors]
        nbytes = [len(b) for b in buffers]
        _transfer(self._file(key, slot), buffers, write=True)
        with self._lock:
            self._written[key] = _Copy(slot, nbytes)
            self.bytes_written += sum(nbytes)
        for tensor in tensors:
            tensor.untyped_storage().resize_(0)

    def _read(self, key: int, copy: _Copy, tensors: list[torch.Tensor]) -> None:
        for tensor, nbytes in zip(tensors, copy.nbytes, strict=True):
            if tensor.untyped_storage().size() != nbytes:
                tensor.untyped_storage().resize_(nbytes)
        _transfer(self._file(key, copy.slot), [_bytes_of(t) for t in tensors], write=False)
        with self._lock:
            self.bytes_read += sum(copy.nbytes)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes (no copy); the tensor must be contiguous, in host memory,
    and kept alive while the bytes are used. Through ctypes, not `Tensor.numpy()`, which marks
    the storage as not resizable for good (the disk tier frees and refills it by resizing)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise RuntimeError(f"the disk tier moves contiguous host tensors, got {tensor.device}")
    nbytes = _nbytes(tensor)
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _transfer(path: Path, buffers: list[memoryview], *, write: bool) -> None:
    """Write `buffers` to `path` back to back (truncating it), or read them from it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY
    fd = os.open(path, flags, 0o600)
    try:
        offset = 0
        call: Callable[[int, list[memoryview], int], int] = os.pwritev if write else os.preadv
        for start in range(0, len(buffers), _MAX_BUFFERS):
            batch = [b for b in buffers[start : start + _MAX_BUFFERS] if len(b)]
            while batch:
                done = call(fd, batch, offset)
                if done <= 0:
                    raise OSError(f"{path}: {'wrote' if write else 'read'} 0 bytes at {offset}")
                offset += done
                batch = _advance(batch, done)
    finally:
        os.close(fd)


def _advance(buffers: list[memoryview], done: int) -> list[memoryview]:
    """What is left of `buffers` after a call moved `done` bytes of them (a short transfer)."""
    left = []
    for buffer in buffers:
        if done >= len(buffer):
            done -= len(buffer)
            continue
        left.append(buffer[done:])
        done = 0
    return left


def _remove(path: Path, executors: tuple[ThreadPoolExecutor, ...]) -> None:
    for executor in executors:
        executor.shutdown(wait=True)
    shutil.rmtree(path, ignore_errors=True)
