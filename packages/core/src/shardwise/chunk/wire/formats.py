"""Wire formats: how a manager's chunks send their parameters and gradients, and the one
object per chunk that does it with buffers of its own.

[Note: wire formats]
Every byte a chunk sends while training goes through its wire (`chunk.wire`), one `ChunkWire`
per chunk built from the manager's `WireFormats`, with two sides, each owning the buffers that
only travel (as FSDP2's `AllGather` / `ReduceScatter` objects allocate theirs):
- the gather side (gather.py) runs every all-gather of the chunk's parameters: stage 3's
  before a module runs, from the primary shards or hpZ's secondary copies, and stages 1-2's
  after the step. `PayloadGather` sends the payload as stored, received into the payload's
  gathered buffer (which the parameters view, or which is cast into their compute copy);
  `QuantizedGather` sends one-byte records and decodes them (see [Note: quantized gathers]).
- the reduce side (reduce.py) runs every sum of the chunk's gradients over ranks: the
  reduce-scatter of stages 1-3 (a bucket of chunks in one, by its first chunk's wire), stage
  1's in-place sum for `.grad`, the replicas' sums of hybrid sharding and stage 0.
  `PayloadReduce` sends the reduce dtype with the reduce-scatter method of [Note:
  reduce-scatter methods] in comm/collectives.py; `QuantizedReduce` sends records (see [Note:
  quantized reductions]).
The payload owns the buffers parameters and optimizer read (chunk/payload.py), the gradient
side those gradients accumulate in (chunk/grads.py); a format is a class here, chosen in
`EngineConfig.communication` and nowhere else. Not on a chunk's wire: the initial broadcast of
values, state-dict gathers of fp32 masters, and the step's agreements (norm, flags, rank
sync), which stay exact.

[Note: quantized gathers]
ZeRO++'s qwZ: each rank sends its shard of the payload as one record of blockwise-quantized
values (int8, or fp8 e4m3, with an fp32 scale per `block_numel` values; see [Note: blockwise
quantization] in comm/quantize.py): 1 + 4 / block_numel bytes per element against the
payload's 2 or 4. Every rank decodes the other ranks' records into the buffer the parameters
compute with, and writes its own slice there from its shard exactly; the fp32 masters, which
the optimizer steps, are never decoded values. So each rank computes with its own parameters
exact and the others' within the format's bound; the ranks' compute buffers differ in those
roundings (each rank's own slice), which the reduced gradients average over. Stage 3 decodes
straight into the compute buffer, so the payload's gathered buffer is not allocated there;
stages 1-2 keep it (their shard is a slice of it), refreshed after each step by the same
gather. Every gather of a chunk from the same shards decodes the same values, so stage 3's
backward computes with the values its forward did.

[Note: quantized gathers and hpZ]
With secondary shards, a rank keeps, of each gather, the records of its secondary span (the
primary shards that span covers, 1/s of the records) until the chunk is released, and then as
its secondary copy; backward's gather exchanges those records inside the secondary group and
decodes them as forward did, each rank writing its own slice from its shard again. Backward so
computes with forward's values exactly, on fewer bytes inside the node too, and the secondary
copy holds a byte per element instead of the payload's 2 or 4.

[Note: quantized reductions]
ZeRO++'s qgZ: a reduce-scatter becomes one all-to-all of records: each rank encodes the slice
of its gradient buffer every other rank owns, sends each its record, and keeps its own slice as
it is; the owner adds the decoded records to its own slice in fp32, in rank order. Rounding
therefore happens once per contribution, on the way, and never accumulates across ranks in a
narrow dtype (which is what lets int4, ZeRO++'s gradient format, serve here at half a byte a
value: see [Note: int4 is for gradients] in comm/quantize.py); the sum is fp32 whatever the
reduce dtype (the reduced slice reaches the fp32
gradient shard as it would). A non-finite gradient decodes to nan on its owner (see [Note:
blockwise quantization]), whose step then finds the overflow. Where every rank must hold the
whole sum (stage 1 for `.grad`, the replicas of hybrid sharding, once per level), the summed
slices come back by an all-gather in the buffer's dtype, exactly, so ranks and replicas stay
alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardwise.chunk.states import ChunkDtypes
from shardwise.chunk.wire.gather import GatherWire, PayloadGather, QuantizedGather
from shardwise.chunk.wire.reduce import PayloadReduce, QuantizedReduce, ReduceWire
from shardwise.comm import CommStats, ReduceScatterMethod
from shardwise.comm.quantize import GATHER_KINDS, BlockQuantizer
from shardwise.comm.topology import Topology


class ChunkWire:
    """One chunk's communication (see [Note: wire formats]).

    Args:
        gather: its parameter all-gathers.
        reduce: its gradient reductions.
    """

    def __init__(self, gather: GatherWire, reduce: ReduceWire) -> None:
        self.gather = gather
        self.reduce = reduce

    def held_bytes(self) -> int:
        """Device bytes of the buffers the wire holds now (between a gather's start and its
        finish, and hpZ's kept records)."""
        return self.gather.held_bytes()


@dataclass(frozen=True, kw_only=True, slots=True)
class WireFormats:
    """How a manager's chunks communicate (see [Note: wire formats]).

    Attributes:
        gather: the parameter gathers' quantization (int8 or fp8), or None to send the
            payload dtype.
        reduce: the gradient reductions' quantization (int8, fp8 or int4), or None to send
            the reduce dtype.
        reduce_method: how an unquantized reduce-scatter runs (see [Note: reduce-scatter
            methods] in comm/collectives.py).
    """

    gather: BlockQuantizer | None = None
    reduce: BlockQuantizer | None = None
    reduce_method: ReduceScatterMethod = ReduceScatterMethod.NATIVE

    def __post_init__(self) -> None:
        for side in ("gather", "reduce"):
            value = getattr(self, side)
            if value is not None and not isinstance(value, BlockQuantizer):
                raise TypeError(f"{side} must be a BlockQuantizer or None, got {value!r}")
        if self.gather is not None and self.gather.kind not in GATHER_KINDS:
            raise ValueError(
                f"gather must quantize to one of {GATHER_KINDS}, got {self.gather.kind!r} "
                f"(see [Note: int4 is for gradients] in comm/quantize.py)"
            )
        if not isinstance(self.reduce_method, ReduceScatterMethod):
            raise TypeError(
                f"reduce_method must be a ReduceScatterMethod, got {self.reduce_method!r}"
            )

    def build(
        self,
        *,
        dtypes: ChunkDtypes,
        device: torch.device,
        stats: CommStats,
        topology: Topology,
        owner: Any,
    ) -> ChunkWire:
        """The wire of one chunk with these dtypes, on `device`, over `topology`'s groups;
        `owner` is the chunk whose resident bytes its buffers count in."""
        gather: GatherWire
        if self.gather is None:
            gather = PayloadGather(dtypes, stats)
        else:
            gather = QuantizedGather(
                self.gather, dtypes, stats, topology.shard, topology.secondary, owner
            )
        reduce: ReduceWire
        if self.reduce is None:
            reduce = PayloadReduce(
                self.reduce_method, stats, topology.shard, topology.replicate, device
            )
        else:
            reduce = QuantizedReduce(self.reduce, stats, topology.shard, topology.replicate, device)
        return ChunkWire(gather, reduce)
