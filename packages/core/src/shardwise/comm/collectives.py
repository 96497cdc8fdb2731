"""Stateless wrappers over torch.distributed collectives that count what they send.

They never see modules or chunks: callers pass flat tensors and a process group, and get back
the torch `Work` handle when `async_op=True`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from shardwise.comm.stats import CommOp, CommStats


def world_size(group: ProcessGroup | None = None) -> int:
    """Ranks in `group`, or 1 when torch.distributed is not initialised (single process)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group`, or 0 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    stats: CommStats,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Gather every rank's `shard` into `output` (shard numel x world size), in rank order."""
    n = world_size(group)
    payload = _nbytes(output)
    stats.record(CommOp.ALL_GATHER, payload, payload * (n - 1) // n)
    if n == 1:
        output.copy_(shard)
        return None
    work: dist.Work | None = dist.all_gather_single(output, shard, group=group, async_op=async_op)
    return work


def reduce_scatter(
    shard_out: torch.Tensor,
    full: torch.Tensor,
    stats: CommStats,
    group: ProcessGroup | None = None,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce `full` over ranks with `op`; rank r receives the r-th slice in `shard_out`."""
    n = world_size(group)
    payload = _nbytes(full)
    stats.record(CommOp.REDUCE_SCATTER, payload, payload * (n - 1) // n)
    if n == 1:
        shard_out.copy_(full)
        return None
    work: dist.Work | None = dist.reduce_scatter_single(
        shard_out, full, op=op, group=group, async_op=async_op
    )
    return work


def all_reduce(
    tensor: torch.Tensor,
    stats: CommStats,
    group: ProcessGroup | None = None,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce `tensor` in place over ranks with `op`."""
    n = world_size(group)
    payload = _nbytes(tensor)
    stats.record(CommOp.ALL_REDUCE, payload, 2 * payload * (n - 1) // n)
    if n == 1:
        return None
    work: dist.Work | None = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return work


def broadcast(
    tensor: torch.Tensor,
    src_rank: int,
    stats: CommStats,
    group: ProcessGroup | None = None,
) -> None:
    """Copy `tensor` from group rank `src_rank` to every rank, in place."""
    n = world_size(group)
    payload = _nbytes(tensor)
    sent = payload if rank(group) == src_rank and n > 1 else 0
    stats.record(CommOp.BROADCAST, payload, sent)
    if n == 1:
        return
    dist.broadcast(tensor, group=group, group_src=src_rank)
