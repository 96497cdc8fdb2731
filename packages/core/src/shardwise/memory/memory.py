"""An engine's memory: where every chunk buffer comes from, and the one copy between devices.

[Note: one allocator, one copy path]
A chunk allocates buffers in two pools (the compute device, host memory; see [Note: pools] in
chunk/chunk.py) and copies between them. Every allocation goes through `Memory`:
- on the compute device: torch's allocator (CUDA's caching allocator reuses freed memory
  itself), or on a CPU device the pool of host buffers when asked (`host_buffer_pool`, see
  [Note: a pool of host buffers] in memory/buffer_pool.py), with huge pages advised on the
  buffers the engine allocates itself (see [Note: huge pages for the engine's buffers] in
  memory/pages.py);
- in host memory: pinned buffers from the pool of memory/pinned.py when the host memory feeds
  a CUDA device and pinning is asked for (`pin_memory`), else plain buffers.
Every copy between devices is `start_copy`: into a buffer from here, on the copy stream where
there are streams, returning a `PendingCopy` that holds its buffers until its event (see
[Note: streams and events] in memory/streams.py). No other code pins memory or copies between
devices; a new tier or a new kind of memory is a change here.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.memory.buffer_pool import BufferPool
from shardwise.memory.host_room import HostRoom
from shardwise.memory.pages import advise_huge_pages
from shardwise.memory.pending import PendingCopy
from shardwise.memory.pinned import PinnedBuffers
from shardwise.memory.streams import Streams

_HOST = torch.device("cpu")


class Memory:
    """Buffers for one engine's chunks, and the copies between their pools.

    Args:
        device: the compute device.
        pooled: keep the CPU device's freed buffers for reuse (see [Note: a pool of host
            buffers]); None: torch's allocator.
        pinned: the pinned host buffers feeding a CUDA device (see [Note: pinned buffers,
            pooled]); None: host buffers are plain memory. (On a CPU device only the tests
            give one, with a pinner that counts, to run the pinned path's logic.)
        streams: the side streams copies run on (see [Note: streams and events]); none by
            default.
        host_room: checks the host has room for each plain host buffer (see [Note: the
            host's room] in memory/host_room.py; the pinned pool checks its own); None:
            unchecked.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        pooled: BufferPool | None = None,
        pinned: PinnedBuffers | None = None,
        streams: Streams | None = None,
        host_room: HostRoom | None = None,
    ) -> None:
        if pooled is not None and device.type != "cpu":
            raise ValueError(f"the pool of host buffers serves a CPU device, not {device}")
        self.device = device
        self.pooled = pooled
        self.pinned = pinned
        self.streams = streams if streams is not None else Streams(device, enabled=False)
        self.host_room = host_room

    # ---- allocation --------------------------------------------------------------------------

    def empty(self, numel: int, dtype: torch.dtype, *, host: bool = False) -> torch.Tensor:
        """A new uninitialised 1-D buffer on the compute device, or in host memory (`host`)."""
        if host:
            if self.pinned is not None:
                return self.pinned.empty(numel, dtype)
            if self.host_room is not None:
                self.host_room.check(numel * dtype.itemsize)
            return _advised(torch.empty(numel, dtype=dtype, device=_HOST))
        if self.pooled is not None:
            return self.pooled.empty(numel, dtype)
        return _advised(torch.empty(numel, dtype=dtype, device=self.device))

    def grow(self, buffer: torch.Tensor) -> None:
        """Give an emptied buffer (a released payload, whose storage its views share) its
        bytes again: from the pool when there is one, else from the allocator."""
        nbytes = buffer.numel() * buffer.element_size()
        storage = buffer.untyped_storage()
        if self.pooled is not None and storage.size() == 0:
            self.pooled.fill(buffer)
        else:
            storage.resize_(nbytes)
            advise_huge_pages(storage)  # see [Note: huge pages for the engine's buffers]

    def holds(self, buffer: torch.Tensor) -> bool:
        """Whether `buffer`'s storage holds the bytes it spans (a pooled buffer may hold a
        few more: its size class)."""
        nbytes = buffer.numel() * buffer.element_size()
        size = buffer.untyped_storage().size()
        return size == nbytes or (size > nbytes and self.pooled is not None)

    def shrink(self, buffer: torch.Tensor) -> None:
        """Free a buffer's bytes, its storage kept empty for its views (a released payload)."""
        if self.pooled is not None:
            self.pooled.free(buffer)
        else:
            buffer.untyped_storage().resize_(0)

    def give_back(self, tensor: torch.Tensor | None) -> None:
        """A buffer its owner dropped: to the pool when one keeps it (pinned buffers return
        to theirs by themselves once nothing views them)."""
        if self.pooled is not None:
            self.pooled.give_back(tensor)

    def keep_room_for(self, buffer_bytes: list[int]) -> None:
        """The chunks' buffer sizes, as packed: the pools keep two of the largest free."""
        for pool in (self.pooled, self.pinned):
            if pool is not None:
                pool.keep_room_for(buffer_bytes)

    @property
    def spare_bytes(self) -> int:
        """Bytes the pools keep free for the next buffers: held by the engine, not model
        state."""
        return sum(pool.spare_bytes for pool in (self.pooled, self.pinned) if pool is not None)

    def drain(self) -> None:
        """Give every free pooled buffer back."""
        for pool in (self.pooled, self.pinned):
            if pool is not None:
                pool.drain()

    # ---- the copy path -----------------------------------------------------------------------

    def start_copy(
        self,
        tensor: torch.Tensor,
        *,
        to_host: bool,
        dtype: torch.dtype | None = None,
        stream: Any = None,
    ) -> PendingCopy:
        """Copy `tensor` (cast to `dtype`) into a new buffer on the compute device, or in host
        memory (`to_host`): on `stream` (the copy stream when None) where there are streams,
        after the work queued so far on the current stream. The pending copy's `wait()`
        gives the buffer, usable where it is (see [Note: streams and events])."""
        dtype = dtype if dtype is not None else tensor.dtype
        target = self.empty(tensor.numel(), dtype, host=to_host).view(tensor.shape)
        return self.start_copy_into(target, tensor, stream=stream)

    def start_copy_into(
        self, target: torch.Tensor, tensor: torch.Tensor, *, stream: Any = None
    ) -> PendingCopy:
        """Copy `tensor` into `target` (an existing buffer, of another device or dtype), as
        `start_copy` does."""
        streams = self.streams
        if not streams.enabled:
            target.copy_(tensor)
            return PendingCopy(target)
        side = stream if stream is not None else streams.copy
        streams.wait(streams.record(), side)  # the source's producer first
        with streams.on(side):
            target.copy_(tensor, non_blocking=True)
        done = streams.record(side)
        for buffer in (tensor, target):
            self.hold_until(buffer, side, done)
        # A device source is kept from reuse by its stream record (hold_until); a host one
        # outside the pool must stay alive until the copy has read it. Keeping a device
        # source too held every reduced gradient on the device until the step read it.
        keep = () if tensor.device.type == "cuda" else (tensor,)
        return PendingCopy(target, done, keep=keep)

    def hold_until(self, buffer: torch.Tensor, stream: Any, done: Any) -> None:
        """Keep `buffer`, used on side `stream`, from reuse until that use's `done` event."""
        if buffer.device.type == "cuda":
            if buffer.untyped_storage().size():
                buffer.record_stream(stream)
        elif self.pinned is not None and self.pinned.owns(buffer):
            self.pinned.note_copy(buffer, done.query, done.synchronize)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a buffer of the pinned pool (which alone may free it)."""
        return self.pinned is not None and self.pinned.owns(tensor)

    def before_host_write(self, tensor: torch.Tensor) -> None:
        """The host is about to write `tensor`: wait for a copy still reading it on a side
        stream (a gather's upload of a host shard), if it is one of the pool's buffers."""
        if self.pinned is not None and self.pinned.owns(tensor):
            self.pinned.wait_for_copy(tensor)

    def __repr__(self) -> str:
        kinds = [
            name
            for name, pool in (("pooled", self.pooled), ("pinned", self.pinned))
            if pool is not None
        ]
        return f"Memory(device={self.device}, pools={kinds}, {self.streams!r})"


def _advised(tensor: torch.Tensor) -> torch.Tensor:
    advise_huge_pages(tensor.untyped_storage())  # before anything writes to it
    return tensor


__all__ = ["Memory"]
