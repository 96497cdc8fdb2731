"""Pinned host buffers for the copies between host memory and a CUDA device, pooled.

[Note: pinned buffers, pooled]
A copy between host memory and a CUDA device runs asynchronously, at the bus's speed, only
from and into page-locked ("pinned") host memory; from pageable memory the driver stages it
through a pinned buffer of its own and the host waits. The engine used to make each host copy
pageable and then pin it (`tensor.to("cpu").pin_memory()`): two copies and a fresh pinned
allocation per call, for every offloaded chunk, every step. torch's pinned allocator caches
what it frees, but in power-of-two blocks: a 1.1 GB chunk side holds 2 GB of the host's
memory, page-locked, for the rest of the process.

So the engine keeps a pool of its own: a host buffer feeding a CUDA device comes from here,
pinned once (`cudaHostRegister` over memory the engine allocated, at the size class of
memory/buffer_pool.py: at most 1.6% more than asked), and goes back to the pool when nothing
views it any more (the pool holds the only other reference, so it finds its free buffers by
their use count, with no call from the code that dropped them) and the last copy it took part
in has completed (its event). Free buffers are kept for the next buffer of their class, up to
`spare_limit_bytes` in all; `drain()` unpins and frees them. Pinning is an injected `Pinner`:
on a host without CUDA the tests give a fake one that counts, so the pool's logic (classes,
reuse, use counts, limits, events) runs on every machine.

A pool that is dropped (its model collected) unpins every buffer it pinned, in use or not: the
memory is freed without `cudaHostUnregister` otherwise, and the allocator hands the same
addresses to the next model, whose registration CUDA then refuses as already registered. An
empty buffer is never pinned (CUDA refuses a registration of zero bytes): the empty gradient
shard a chunk starts with is a plain tensor.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shardwise.memory.buffer_pool import size_class
from shardwise.memory.host_room import HostRoom
from shardwise.memory.pages import advise_huge_pages


class Pinner(Protocol):
    """Page-locks host memory for a device's copies, and unlocks it."""

    def pin(self, storage: torch.UntypedStorage) -> None: ...

    def unpin(self, storage: torch.UntypedStorage) -> None: ...


class CudaHostRegister:
    """Pins with `cudaHostRegister` (the memory stays the engine's allocation, at its size)."""

    def pin(self, storage: torch.UntypedStorage) -> None:
        # cudaHostRegisterPortable, as torch registers memory: pinned for every context.
        error = torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), 1)
        if int(error) != 0:
            raise RuntimeError(
                f"cudaHostRegister of {storage.nbytes()} bytes failed with CUDA error "
                f"{int(error)}: the host may be out of page-lockable memory (ulimit -l); "
                f"set gemini_config['pin_memory']=False to copy from pageable memory"
            )

    def unpin(self, storage: torch.UntypedStorage) -> None:
        torch.cuda.cudart().cudaHostUnregister(storage.data_ptr())


@dataclass(eq=False)
class _Buffer:
    storage: torch.UntypedStorage
    # Whether the last copy that read or wrote it has completed (None: no copy pending).
    copy_done: Callable[[], bool] | None = field(default=None)
    # Waits for that copy (None: nothing to wait for).
    wait_copy: Callable[[], None] | None = field(default=None)


class PinnedBuffers:
    """Pinned host buffers, reused by size class (see [Note: pinned buffers, pooled]).

    Args:
        pinner: pins and unpins the memory.
        spare_limit_bytes: the most it keeps free for reuse; a buffer freed beyond it is
            unpinned and given back.
        room: checks the host has room for each new buffer (see [Note: the host's room] in
            memory/host_room.py); None: unchecked.
    """

    def __init__(
        self, pinner: Pinner, spare_limit_bytes: int = 0, *, room: HostRoom | None = None
    ) -> None:
        if spare_limit_bytes < 0:
            raise ValueError(f"spare_limit_bytes must be >= 0, got {spare_limit_bytes}")
        self._pinner = pinner
        self._room = room
        self.spare_limit_bytes = spare_limit_bytes
        self._buffers: defaultdict[int, list[_Buffer]] = defaultdict(list)
        self._by_storage: dict[int, _Buffer] = {}
        self.pins = 0  # memory pinned, counted per buffer (for tests and reports)
        self.reused = 0  # buffers handed out again
        # Unpins what is left when the pool is dropped; holds the buffers, not the pool.
        weakref.finalize(self, _unpin_all, pinner, self._buffers)

    def keep_room_for(self, buffer_bytes: list[int]) -> None:
        """Keep up to two of the largest of `buffer_bytes` free between uses."""
        if buffer_bytes:
            self.spare_limit_bytes = max(self.spare_limit_bytes, 2 * size_class(max(buffer_bytes)))

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host tensor of `numel` elements over pinned memory: a free buffer of its size
        class if there is one, else a new one, pinned now (none for no elements)."""
        tensor = torch.empty(0, dtype=dtype)
        if numel == 0:
            return tensor  # nothing to pin, and CUDA refuses to pin zero bytes
        nbytes = numel * tensor.element_size()
        buffer = self._free_buffer(nbytes)
        if buffer is None:
            self._trim()
            if self._room is not None:
                self._room.check(size_class(nbytes))
            storage = torch.UntypedStorage(size_class(nbytes))
            advise_huge_pages(storage)
            self._pinner.pin(storage)
            self.pins += 1
            buffer = _Buffer(storage)
            self._buffers[size_class(nbytes)].append(buffer)
            self._by_storage[storage.data_ptr()] = buffer
        else:
            self.reused += 1
        buffer.copy_done = buffer.wait_copy = None
        return tensor.set_(buffer.storage, 0, (numel,), (1,))

    def note_copy(
        self,
        tensor: torch.Tensor,
        done: Callable[[], bool],
        wait: Callable[[], None] | None = None,
    ) -> None:
        """`tensor` (from this pool) takes part in a copy that `done()` says has completed
        (and `wait()` waits for): its buffer is not handed out again before."""
        buffer = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if buffer is not None:
            buffer.copy_done, buffer.wait_copy = done, wait

    def wait_for_copy(self, tensor: torch.Tensor) -> None:
        """Before the host writes `tensor` (from this pool): wait for the last copy that read
        it, which may still be running on a device's stream."""
        buffer = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if buffer is None or buffer.copy_done is None or buffer.copy_done():
            return
        if buffer.wait_copy is not None:
            buffer.wait_copy()

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._by_storage

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned now, in use or free."""
        return sum(b.storage.nbytes() for buffers in self._buffers.values() for b in buffers)

    @property
    def spare_bytes(self) -> int:
        """Bytes pinned and free for the next buffers."""
        return sum(
            b.storage.nbytes() for buffers in self._buffers.values() for b in buffers if _free(b)
        )

    def drain(self) -> None:
        """Unpin and give back every free buffer (those in use stay until dropped and drained
        again)."""
        for nbytes in list(self._buffers):
            for buffer in [b for b in self._buffers[nbytes] if _free(b)]:
                self._forget(nbytes, buffer)

    def _free_buffer(self, nbytes: int) -> _Buffer | None:
        for buffer in self._buffers.get(size_class(nbytes), []):
            if buffer.storage.nbytes() >= nbytes and _free(buffer):
                return buffer
        return None

    def _trim(self) -> None:
        """Before pinning more: unpin free buffers, largest first, until what is free is
        within the limit (none of them served the buffer asked for)."""
        free = self.spare_bytes
        for nbytes in sorted(self._buffers, reverse=True):
            for buffer in [b for b in self._buffers[nbytes] if _free(b)]:
                if free <= self.spare_limit_bytes:
                    return
                free -= buffer.storage.nbytes()
                self._forget(nbytes, buffer)

    def _forget(self, nbytes: int, buffer: _Buffer) -> None:
        self._buffers[nbytes].remove(buffer)
        if not self._buffers[nbytes]:
            del self._buffers[nbytes]
        del self._by_storage[buffer.storage.data_ptr()]
        self._pinner.unpin(buffer.storage)


def _unpin_all(pinner: Pinner, buffers: dict[int, list[_Buffer]]) -> None:
    """A dropped pool's buffers, unpinned (see [Note: pinned buffers, pooled])."""
    for group in buffers.values():
        for buffer in group:
            pinner.unpin(buffer.storage)
    buffers.clear()


def _free(buffer: _Buffer) -> bool:
    """Nothing but the pool references the buffer's memory, and its last copy completed."""
    # The pool's storage object holds one reference; every tensor viewing it another.
    if torch._C._storage_Use_Count(buffer.storage._cdata) > 1:
        return False
    return buffer.copy_done is None or buffer.copy_done()


__all__ = ["CudaHostRegister", "PinnedBuffers", "Pinner"]
