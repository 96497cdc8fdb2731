"""Chunk-sized host buffers kept for reuse by the engine that freed them, on request.

[Note: a pool of host buffers]
A sharded step on a CPU host frees and allocates chunk-sized buffers over and over: every
gather fills a payload's storage and every release empties it, every backward allocates each
chunk's gradient buffer and the reduction frees it. The C library gives a large freed block
straight back to the kernel, so each new one is fresh memory the kernel faults in and zeroes
on first write. The engine's own buffers are faulted in 2 MiB pages (see [Note: huge pages for
the engine's buffers] in memory/pages.py), which takes most of that cost away; with
`host_buffer_pool=True` the engine also keeps what a chunk frees and hands it to the next
buffer of its size class, so that no page is faulted or zeroed again. It moves memory between
storages with `UntypedStorage._swap_data_ptr_`, so a payload keeps its storage object (the
one its parameters, and tensors autograd saved, view): emptying the storage to the pool looks
to every view exactly as resizing it to zero did, and no view can reach memory the pool hands
out again. A gradient buffer is taken back only where nothing else views it.

The cost is memory, which is why the pool is off unless asked for: a spare is memory the
process would otherwise have given back while the step went on, so it adds to the peak
whenever it waits through other allocations (activations, autograd's gradients) for the next
buffer of its class. On a 117M GPT (2 ranks, stage 3, 4 KiB pages) two spares kept across
passes made the step 12% shorter and the peak 143 MiB higher per rank; drained at the end of
each pass and evicted by any allocation they could not serve, they saved no time and still
added 84 MiB (benchmarks/RESULTS.md, "A pool of host buffers").

Chunks of one model differ in size by a few elements (a layer's parameters rarely fill a chunk
exactly), so the pool files buffers by size class (sizes rounded up to 1/64 of their power of
two) and allocates a new one at its class's size: any spare of a class serves any buffer of it,
at most 1.6% larger than the buffer needs (the storage holds those bytes; the tensor spans its
own elements). What it holds is bounded (`spare_limit_bytes`: two buffers of the manager's
largest chunk) and counted (`spare_bytes`, reported by `ZeroModel.pooled_bytes()`, apart from
model state); `drain()` frees it (`ZeroModel.release_module()` does). It serves CPU buffers
only: CUDA's caching allocator already reuses device memory; and not under a placement that
holds the device to a budget ("auto", a `device_budget_bytes`), whose budget it would take from.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from shardwise.memory.pages import advise_huge_pages


def pool_supported() -> bool:
    """Whether this torch moves memory between storage objects (`_swap_data_ptr_`, in torch
    2.13; not in 2.11), which the pool needs."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


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
            self.spare_limit_bytes = max(self.spare_limit_bytes, 2 * size_class(max(buffer_bytes)))

    def fill(self, tensor: torch.Tensor) -> None:
        """Give `tensor`'s empty storage at least the bytes `tensor` spans: a spare buffer of
        their size class, or a new one of the class's size (its contents are undefined, as a
        fresh allocation's)."""
        storage = tensor.untyped_storage()
        if storage.nbytes() != 0:
            raise RuntimeError(f"fill() of a storage holding {storage.nbytes()} bytes")
        nbytes = tensor.numel() * tensor.element_size()
        spare = self._take(nbytes)
        if spare is None:
            storage.resize_(size_class(nbytes))
            advise_huge_pages(storage)
        else:
            _move_memory(spare, storage)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D host tensor of `numel` elements, over a spare buffer of its size class
        if there is one, else over a new one of the class's size."""
        tensor = torch.empty(0, dtype=dtype)
        nbytes = numel * tensor.element_size()
        spare = self._take(nbytes)
        storage = tensor.untyped_storage()
        if spare is None:
            storage = torch.UntypedStorage(size_class(nbytes))
            advise_huge_pages(storage)
        else:
            _move_memory(spare, storage)
        return tensor.set_(storage, 0, (numel,), (1,))

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
        self._spares[size_class(nbytes)].append(spare)
        self.spare_bytes += nbytes

    def give_back(self, tensor: torch.Tensor | None) -> None:
        """Keep a dropped buffer's memory spare, if no other tensor views it (a gradient
        buffer `.grad` still shows stays with its holders)."""
        if tensor is not None and tensor.device.type == "cpu" and _only_view(tensor):
            self.free(tensor)

    def drain(self) -> None:
        """Give every spare buffer back to the allocator."""
        self._spares.clear()
        self.spare_bytes = 0

    def _take(self, nbytes: int) -> torch.UntypedStorage | None:
        """A spare of `nbytes`' size class holding at least `nbytes` (one freed from outside
        the pool may hold fewer than its class), out of the pool."""
        spares = self._spares.get(size_class(nbytes), [])
        for index in range(len(spares) - 1, -1, -1):
            if spares[index].nbytes() >= nbytes:
                spare = spares.pop(index)
                self.spare_bytes -= spare.nbytes()
                self.reused += 1
                return spare
        return None


def size_class(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of 1/64 of its power of two (at most 1.6% more), for
    sizes above 64 KiB; smaller ones are their own class."""
    if nbytes <= 1 << 16:
        return nbytes
    step = 1 << (nbytes.bit_length() - 7)
    return -(-nbytes // step) * step


def _only_view(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is the only tensor over its storage, from its start."""
    storage = tensor.untyped_storage()
    # The storage's references: this tensor's and the Python object `storage` just made.
    return tensor.storage_offset() == 0 and torch._C._storage_Use_Count(storage._cdata) <= 2


def _move_memory(source: torch.UntypedStorage, empty: torch.UntypedStorage) -> None:
    """Give `empty`'s storage object the memory `source` holds, leaving `source` empty:
    every tensor viewing either storage object keeps viewing it."""
    assert empty.nbytes() == 0
    empty._swap_data_ptr_(source)  # type: ignore[attr-defined]  # torch's, untyped


__all__ = ["BufferPool", "pool_supported", "size_class"]
