"""Collectives that count their bytes, and the counters they write to."""

from shardwise.comm.collectives import (
    ReduceScatterMethod,
    Waitable,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    gather_pieces,
    rank,
    reduce_scatter,
    reduce_to_shard,
    world_size,
)
from shardwise.comm.lifecycle import check_launched_group, destroy_default_group_at_exit
from shardwise.comm.objects import all_gather_object, barrier, broadcast_object
from shardwise.comm.stats import CommOp, CommStats, OpCount

__all__ = [
    "CommOp",
    "CommStats",
    "OpCount",
    "ReduceScatterMethod",
    "Waitable",
    "all_gather",
    "all_gather_object",
    "all_to_all",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "check_launched_group",
    "destroy_default_group_at_exit",
    "gather_pieces",
    "rank",
    "reduce_scatter",
    "reduce_to_shard",
    "world_size",
]
