"""Moves of a chunk's buffers between the compute device and host memory (see [Note: pools]
in chunk.py): once when the memory manager places a chunk, and while training under "auto"."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardwise.chunk.states import ChunkDtypes, Pool

if TYPE_CHECKING:
    from shardwise.chunk.grads import GradSide


class PoolMoves:
    """The pool moves of `Chunk`, which sets every attribute declared here."""

    chunk_id: int
    device: torch.device
    offload_device: torch.device
    pin_memory: bool
    bytes_to_device: int
    bytes_to_host: int
    keep_gathered: bool
    requires_grad: bool
    dtypes: ChunkDtypes
    shard: torch.Tensor
    master: torch.Tensor
    grads: GradSide
    payload_pool: Pool
    optim_pool: Pool

    def move_to(
        self, tensor: torch.Tensor, pool: Pool, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A copy of `tensor` in `pool`, counted; pinned in host memory when asked and useful."""
        nbytes = tensor.numel() * tensor.element_size()
        if pool is Pool.DEVICE:
            self.bytes_to_device += nbytes
            return tensor.to(self.device, dtype, non_blocking=True, copy=True)
        self.bytes_to_host += nbytes
        moved = tensor.to(self.offload_device, dtype, copy=True)
        if self.pin_memory and self.device.type == "cuda":
            moved = moved.pin_memory()
        return moved

    def place(self, *, payload: Pool, optim: Pool, pin_memory: bool = False) -> None:
        """Put the shard in `payload` and the optimizer side in `optim` (see [Note: pools]).
        Call once after close() and before an optimizer steps this chunk."""
        if payload is Pool.HOST and self.keep_gathered:
            raise ValueError(
                f"chunk {self.chunk_id} keeps its payload gathered on the device: its shard "
                f"cannot live in host memory"
            )
        self.pin_memory = pin_memory
        if payload is not self.payload_pool:
            self.shard = self.move_to(self.shard, payload)
            self.payload_pool = payload
        if self.requires_grad:
            aliased = self.dtypes.payload == torch.float32 and payload is optim
            if aliased:
                self.master = self.shard
            elif optim is not self.optim_pool or self.master is self.shard:
                self.master = self.move_to(self.master, optim, torch.float32)
            if optim is not self.optim_pool:
                self.grads.shard = self.move_to(self.grads.shard, optim)
        self.optim_pool = optim

    def move_payload(self, pool: Pool) -> None:
        """Move the shard to `pool` while training runs (the "auto" policy). A master that was
        the shard itself stays where it is, as its own tensor, since the optimizer holds views
        of it."""
        if pool is self.payload_pool:
            return
        if self.keep_gathered:
            raise ValueError(f"chunk {self.chunk_id} keeps its payload gathered on the device")
        self.shard = self.move_to(self.shard, pool)
        self.payload_pool = pool

    def move_optim(self, pool: Pool) -> None:
        """Move the fp32 master and gradient shard to `pool`; the optimizer must then re-point
        its views (ZeroOptimizer.rebind_chunk) and move its state. An fp32 master that lands
        beside its shard becomes the shard itself."""
        if pool is self.optim_pool or not self.requires_grad:
            self.optim_pool = pool
            return
        if self.dtypes.payload == torch.float32 and pool is self.payload_pool:
            # An fp32 shard in the same pool is the master again, as place() makes it: no
            # second copy to hold, nor to copy into the shard after every step.
            self.shard.copy_(self.move_to(self.master, pool))
            self.master = self.shard
        else:
            self.master = self.move_to(self.master, pool, torch.float32)
        self.grads.shard = self.move_to(self.grads.shard, pool)
        self.optim_pool = pool
