"""An engine's memory: the allocator of every chunk buffer (plain, pooled, pinned), the one
copy path between the device and host memory, the side streams copies run on, and the pending
objects of work in flight (see [Note: one allocator, one copy path] in memory/memory.py)."""

from shardwise.memory.buffer_pool import BufferPool, pool_supported
from shardwise.memory.host_room import HostMemoryExhausted, HostRoom
from shardwise.memory.memory import Memory
from shardwise.memory.pending import Done, Pending, PendingCopy
from shardwise.memory.pinned import CudaHostRegister, PinnedBuffers, Pinner
from shardwise.memory.streams import Streams

__all__ = [
    "BufferPool",
    "CudaHostRegister",
    "Done",
    "HostMemoryExhausted",
    "HostRoom",
    "Memory",
    "Pending",
    "PendingCopy",
    "PinnedBuffers",
    "Pinner",
    "Streams",
    "pool_supported",
]
