"""What every chunk of one manager shares: dtypes, device, groups, counters and wire formats."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup

from shardwise.chunk.states import ChunkDtypes
from shardwise.chunk.wire import WireFormats
from shardwise.comm import CommStats
from shardwise.comm.topology import Topology
from shardwise.memory import Memory


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkContext:
    """The manager-wide settings a chunk is built with, fixed for its life (`ChunkManager`
    builds one and hands it to every chunk it makes).

    Attributes:
        dtypes: payload, compute and reduce dtypes.
        device: where payloads, gathered buffers and gradient buffers live.
        topology: the groups: chunks are sharded over `topology.shard`; hybrid sharding's
            `replicate` group receives the initial broadcast too (see [Note: hybrid sharding]
            in comm/topology.py); hpZ gathers from secondary copies over `secondary` (see
            [Note: secondary shards] in chunk/chunk.py).
        stats: collective counters.
        predivide_factor: gradients are divided by this before the reduction and by N / this
            after it, which keeps fp16 sums of many ranks from overflowing.
        wire: how parameters are gathered and gradients reduced (see [Note: wire formats] in
            chunk/wire/formats.py).
        memory: where every buffer comes from, and the one copy between pools (see [Note:
            one allocator, one copy path] in memory/memory.py).
    """

    dtypes: ChunkDtypes
    device: torch.device
    topology: Topology
    stats: CommStats
    predivide_factor: float = 1.0
    memory: Memory
    wire: WireFormats = field(default_factory=WireFormats)

    @property
    def group(self) -> ProcessGroup | None:
        """The group chunks are sharded over."""
        return self.topology.shard
