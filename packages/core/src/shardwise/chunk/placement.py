"""Where a chunk's resident buffers live (see [Note: pools] in chunk.py): the pool of its
payload shard and the pool of its optimizer side, and the counted copies between them."""

from __future__ import annotations

import torch

from shardwise.chunk.disk_pool import DiskPool
from shardwise.chunk.resident import Resident
from shardwise.chunk.states import Pool


class ChunkPlacement:
    """The two pools of one chunk and the bytes copied between them.

    Args:
        owner: the chunk, whose resident changes these are (see [Note: resident changes]).
        device: the compute device (the DEVICE pool); the HOST pool is the CPU.
    """

    payload = Resident[Pool]()
    """Where the payload shard lives (host memory only for a sharded chunk)."""
    optim = Resident[Pool]()
    """Where the optimizer side lives: the fp32 master, the gradient shard and, through the
    views the optimizer steps, its state (DISK: master and state in files, the gradient shard
    in host memory)."""

    def __init__(self, owner: object, device: torch.device) -> None:
        self.__dict__["_resident_owner"] = owner
        self.device = device
        self.host = torch.device("cpu")
        self.payload = Pool.DEVICE
        self.optim = Pool.DEVICE
        # Pin host copies (only useful when they feed a CUDA device).
        self.pin_memory = False
        self.bytes_to_device = 0
        self.bytes_to_host = 0
        # The disk tier holding the master and state while `optim` is DISK.
        self.disk: DiskPool | None = None
        self.bytes_to_disk = 0
        self.bytes_from_disk = 0

    @property
    def optim_memory(self) -> Pool:
        """The memory pool of the optimizer side's resident part: its own pool, or host
        memory for a side on the disk tier (its gradient shard, and its master and state
        while the step holds them)."""
        return Pool.HOST if self.optim is Pool.DISK else self.optim

    def move_to(
        self, tensor: torch.Tensor, pool: Pool, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A copy of `tensor` in `pool`, counted; pinned in host memory when asked and useful."""
        nbytes = tensor.numel() * tensor.element_size()
        if pool is Pool.DEVICE:
            self.bytes_to_device += nbytes
            return tensor.to(self.device, dtype, non_blocking=True, copy=True)
        self.bytes_to_host += nbytes
        moved = tensor.to(self.host, dtype, copy=True)
        if self.pin_memory and self.device.type == "cuda":
            moved = moved.pin_memory()
        return moved

    def empty(self, numel: int, dtype: torch.dtype, pool: Pool) -> torch.Tensor:
        """A new uninitialised buffer in `pool`'s memory (pinned as `move_to` pins)."""
        if pool is Pool.DEVICE:
            return torch.empty(numel, dtype=dtype, device=self.device)
        buffer = torch.empty(numel, dtype=dtype, device=self.host)
        if self.pin_memory and self.device.type == "cuda":
            buffer = buffer.pin_memory()
        return buffer

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
