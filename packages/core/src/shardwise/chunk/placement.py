"""Where a chunk's resident buffers live (see [Note: pools] in chunk.py): the pool of its
payload shard and the pool of its optimizer side, and the counted copies between them, all
through the engine's memory (see [Note: one allocator, one copy path] in memory/memory.py)."""

from __future__ import annotations

from typing import Any

import torch

from shardwise.chunk.resident import Resident
from shardwise.chunk.states import Pool
from shardwise.chunk.tiers import IN_MEMORY, OnDisk, SideTier
from shardwise.memory import Memory, PendingCopy
from shardwise.memory.disk_pool import DiskPool


class ChunkPlacement:
    """The two pools of one chunk and the bytes copied between them.

    Args:
        owner: the chunk, whose resident changes these are (see [Note: resident changes]).
        memory: the engine's memory, on the compute device (the DEVICE pool); the HOST pool
            is the CPU.
    """

    payload = Resident[Pool]()
    """Where the payload shard lives (host memory only for a sharded chunk)."""
    optim = Resident[Pool]()
    """Where the optimizer side lives: the fp32 master, the gradient shard and, through the
    views the optimizer steps, its state (DISK: master and state in files, the gradient shard
    in host memory)."""

    def __init__(self, owner: object, memory: Memory) -> None:
        self.__dict__["_resident_owner"] = owner
        self.memory = memory
        self.device = memory.device
        self.host = torch.device("cpu")
        self.payload = Pool.DEVICE
        self.optim = Pool.DEVICE
        self.bytes_to_device = 0
        self.bytes_to_host = 0
        # Where the optimizer side lives between steps (see [Note: tiers] in tiers.py): the
        # disk tier's files while `optim` is DISK, else memory.
        self.tier: SideTier = IN_MEMORY
        self.bytes_to_disk = 0
        self.bytes_from_disk = 0

    @property
    def optim_memory(self) -> Pool:
        """The memory pool of the optimizer side's resident part: its own pool, or host
        memory for a side on the disk tier (its gradient shard, and its master and state
        while the step holds them)."""
        return Pool.HOST if self.optim is Pool.DISK else self.optim

    def start_move(
        self,
        tensor: torch.Tensor,
        pool: Pool,
        dtype: torch.dtype | None = None,
        *,
        stream: Any = None,
    ) -> PendingCopy:
        """Start copying `tensor` into a new buffer of `pool` (cast to `dtype`), counted: the
        one copy between pools (see [Note: one allocator, one copy path]), on `stream` (the
        copy stream when None, where there are streams). Its `wait()` gives the copy, usable
        where it is."""
        self.count_copy(tensor, into=pool)
        return self.memory.start_copy(
            tensor, to_host=pool is not Pool.DEVICE, dtype=dtype, stream=stream
        )

    def start_copy_into(
        self, target: torch.Tensor, tensor: torch.Tensor, into: Pool
    ) -> PendingCopy:
        """Start copying `tensor` into `target`, a buffer of pool `into`, counted in the
        narrower of their dtypes (a 16-bit side is what needs to cross: gradients reduced in
        16 bits, parameters published into a 16-bit payload)."""
        self.count_bytes(min(_nbytes(target), _nbytes(tensor)), into=into)
        return self.memory.start_copy_into(target, tensor)

    def move_to(
        self, tensor: torch.Tensor, pool: Pool, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A copy of `tensor` in `pool`, counted, usable once this returns."""
        return self.start_move(tensor, pool, dtype).wait()

    def empty(self, numel: int, dtype: torch.dtype, pool: Pool) -> torch.Tensor:
        """A new uninitialised buffer in `pool`'s memory (host memory feeding a CUDA device
        pinned where asked, from the engine's pool)."""
        return self.memory.empty(numel, dtype, host=pool is not Pool.DEVICE)

    @property
    def disk(self) -> DiskPool | None:
        """The disk tier holding the master and state while `optim` is DISK."""
        return self.tier.pool if isinstance(self.tier, OnDisk) else None

    def count_disk(self, nbytes: int, read: bool) -> None:
        """Count `nbytes` read from the disk tier (`read`) or written to it."""
        if read:
            self.bytes_from_disk += nbytes
        else:
            self.bytes_to_disk += nbytes

    def count_copy(self, tensor: torch.Tensor, into: Pool) -> None:
        """Count a copy of `tensor` made elsewhere into `into` (an in-place copy_ between
        pools)."""
        self.count_bytes(tensor.numel() * tensor.element_size(), into)

    def count_bytes(self, nbytes: int, into: Pool) -> None:
        """Count `nbytes` copied elsewhere into `into`."""
        if into is Pool.DEVICE:
            self.bytes_to_device += nbytes
        else:
            self.bytes_to_host += nbytes


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
