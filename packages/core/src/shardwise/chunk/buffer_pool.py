"""Chunk-sized host buffers kept for reuse by the engine that freed them.

[Note: a pool of host buffers]
A sharded step on a CPU host frees and allocates chunk-sized buffers over and over: every
gather fills a payload's storage and every release empties it, every backward allocates each
chunk's gradient buffer and the reduction frees it. The C library gives a large freed block
straight back to the kernel, so each new one is fresh memory whose 4 KiB pages fault and are
zeroed on first write (a 256 MB buffer filled: 0.17 s). The pool keeps what a chunk frees and
hands it to the next buffer of the same size instead: no fault, no zeroing, whatever the
process's allocator settings or the order of imports. It moves memory between storages with
`UntypedStorage._swap_data_ptr_`, so a payload keeps its storage object (the one its
parameters, and tensors autograd saved, view): emptying the storage to the pool looks to every
view exactly as resizing it to zero did, and no view can reach memory the pool hands out again.
A gradient buffer is taken back only where nothing else views it (`owns_storage`).

What it holds is bounded (`spare_limit_bytes`, by default two buffers of the manager's largest
chunk) and counted (`spare_bytes`, reported by `ZeroModel.pooled_bytes()`, apart from model state);
`drain()` frees it (`ZeroModel.release_module()` does). It serves CPU buffers only: CUDA's
caching allocator already reuses device memory. A placement that holds the device to a budget
("auto", a `device_budget_bytes`) gets no pool, so that nothing outside the chunks' own
buffers takes from the budget.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from shardwise.chunk.grad_buffer import owns_storage


class BufferPool:
    """Spare host memory for chunk buffers, filed by size.

    Args:
        spare_limit_bytes: the most it keeps spare; a buffer freed beyond it goes back to the
            allocator.
    """

    def __init__(self, spare_limit_bytes: int) -> None:
        if spare_limit_bytes < 0:
            raise ValueError(f"spare_limit_bytes must be >= 0, got {spare_limit_bytes}")
        self.spare_limit_bytes = spare_limit_bytes
        self._spares: defaultdict[int, list[torch.UntypedStorage]] = defaultdict(list)
        self.spare_bytes = 0
        self.reused = 0  # buffers served from the pool, for tests and reports

    def keep_room_for(self, buffer_bytes: list[int]) -> None:
        """Raise the spare limit to two of the largest of `buffer_bytes` (the chunks just
        packed), if it is lower: enough that each buffer a pass frees serves the next."""
        if buffer_bytes:
            self.spare_limit_bytes = max(self.spare_limit_bytes, 2 * max(buffer_bytes))

    def fill(self, tensor: torch.Tensor) -> None:
        """Give `tensor`'s empty storage the bytes `tensor` spans, spare memory if the pool
        has a buffer of that size (its contents are undefined, as a fresh allocation's)."""
        storage = tensor.untyped_storage()
        nbytes = tensor.numel() * tensor.element_size()
        if storage.nbytes() != 0:
            raise RuntimeError(f"fill() of a storage holding {storage.nbytes()} bytes")
        spare = self._take(nbytes)
        if spare is None:
            storage.resize_(nbytes)
        else:
            _move_memory(spare, storage)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D host tensor of `numel` elements, in spare memory if there is some."""
        tensor = torch.empty(0, dtype=dtype)
        spare = self._take(numel * tensor.element_size())
        if spare is None:
            return torch.empty(numel, dtype=dtype)
        _move_memory(spare, tensor.untyped_storage())
        return tensor.set_(tensor.untyped_storage(), 0, (numel,), (1,))

    def free(self, tensor: torch.Tensor) -> None:
        """Empty `tensor`'s storage (every view of it sees no element, as after
        `resize_(0)`), keeping its memory spare while the limit allows."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        if self.spare_bytes + nbytes > self.spare_limit_bytes:
            storage.resize_(0)
            return
        spare = torch.UntypedStorage(0)
        _move_memory(storage, spare)
        self._spares[nbytes].append(spare)
        self.spare_bytes += nbytes

    def give_back(self, tensor: torch.Tensor | None) -> None:
        """Keep a dropped buffer's memory spare, if no other tensor views it (a gradient
        buffer `.grad` still shows stays with its holders)."""
        if tensor is not None and tensor.device.type == "cpu" and owns_storage(tensor):
            self.free(tensor)

    def drain(self) -> None:
        """Give every spare buffer back to the allocator."""
        self._spares.clear()
        self.spare_bytes = 0

    def _take(self, nbytes: int) -> torch.UntypedStorage | None:
        spares = self._spares.get(nbytes)
        if not spares:
            return None
        self.spare_bytes -= nbytes
        self.reused += 1
        return spares.pop()


def _move_memory(source: torch.UntypedStorage, empty: torch.UntypedStorage) -> None:
    """Give `empty`'s storage object the memory `source` holds, leaving `source` empty:
    every tensor viewing either storage object keeps viewing it."""
    assert empty.nbytes() == 0
    empty._swap_data_ptr_(source)  # type: ignore[attr-defined]  # torch's, untyped


__all__ = ["BufferPool"]
