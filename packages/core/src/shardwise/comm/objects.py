"""Agreements between ranks: barriers and small picklable Python objects, counted like the
tensor collectives (as `CommOp.CONTROL`). Single-process runs need no process group."""

from __future__ import annotations

import pickle
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise.comm.collectives import rank, world_size
from shardwise.comm.stats import CommOp, CommStats


def all_gather_object(value: Any, stats: CommStats, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's `value`, in rank order."""
    n = world_size(group)
    size = len(pickle.dumps(value))
    stats.record(CommOp.CONTROL, size * n, size * (n - 1))
    if n == 1:
        return [value]
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def broadcast_object(value: Any, stats: CommStats, group: ProcessGroup | None = None) -> Any:
    """The `value` of the group's first rank, on every rank of the group."""
    n = world_size(group)
    size = len(pickle.dumps(value))
    first = rank(group) == 0
    stats.record(CommOp.CONTROL, size, size if first else 0)
    if n == 1:
        return value
    holder = [value]
    source = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(holder, src=source, group=group)
    return holder[0]


def barrier(stats: CommStats, group: ProcessGroup | None = None) -> None:
    """Wait until every rank of `group` arrives."""
    stats.record(CommOp.CONTROL, 0, 0)
    if world_size(group) > 1:
        dist.barrier(group=group)
