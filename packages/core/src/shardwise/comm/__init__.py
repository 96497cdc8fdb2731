"""Collectives that count their bytes, and the counters they write to."""

from shardwise.comm.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    rank,
    reduce_scatter,
    world_size,
)
from shardwise.comm.stats import CommOp, CommStats, OpCount

__all__ = [
    "CommOp",
    "CommStats",
    "OpCount",
    "all_gather",
    "all_reduce",
    "broadcast",
    "rank",
    "reduce_scatter",
    "world_size",
]
