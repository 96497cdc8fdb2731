"""Counting of collective calls and bytes, per op kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class CommOp(str, Enum):
    """The collective kinds the engine issues."""

    ALL_GATHER = "all_gather"
    """Each rank contributes a shard; every rank receives the whole buffer."""
    REDUCE_SCATTER = "reduce_scatter"
    """Every rank contributes a whole buffer; each receives the reduced shard it owns."""
    ALL_REDUCE = "all_reduce"
    """Every rank contributes and receives a whole buffer (norms, overflow flags, DDP grads)."""
    BROADCAST = "broadcast"
    """One rank's buffer is copied to all (initial parameter sync)."""
    REPLICATE_ALL_REDUCE = "replicate_all_reduce"
    """Hybrid sharding: the gradient shards all-reduced, once per step, with the ranks holding
    the same shards in the other shard groups: the only step traffic that crosses groups."""
    SECONDARY_ALL_GATHER = "secondary_all_gather"
    """ZeRO++ hpZ: a chunk gathered from the secondary shards kept inside a group of
    `secondary_shard_size` ranks (one node's fast links), not from the primary shards."""
    GATHER = "gather"
    """Each rank sends its parts to one rank, which alone receives the whole (a state dict or
    checkpoint kept on one rank); bytes sent are each rank's own parts."""
    CONTROL = "control"
    """Agreements between ranks outside the step: barriers and small pickled Python objects
    (checkpoint tokens and file lists, run ids, error reports); bytes are the pickles'."""


@dataclass(slots=True)
class OpCount:
    """Calls and bytes of one op kind.

    `payload_bytes` is the size of the whole logical buffer (the gathered output, the
    reduce-scatter input, the all-reduced tensor). `sent_bytes` is what one rank sends with a
    bandwidth-optimal ring algorithm: (N-1)/N of the payload for all-gather and reduce-scatter,
    twice that for all-reduce, and the payload itself for the source of a broadcast. The ZeRO
    analysis (2 psi for stages 1 and 2, 3 psi for stage 3) is stated in these terms.

    [Note: unquantized bytes]
    `unquantized_sent_bytes` is what the same collectives would have sent in the unquantized
    ("dtype") wire formats: `sent_bytes` itself for every collective but those of a quantized
    wire, which compute it from the chunk's sizes and the payload or reduce dtype, by the
    formula the unquantized wire's collective is counted by (chunk/wire/gather.py,
    chunk/wire/reduce.py). Per step the two totals compare what quantization saved; per kind
    they compare too, except where the unquantized format would have run another collective
    (stage 1's in-backward average is an all-reduce unquantized, a reduce-scatter and an
    all-gather quantized: the same bytes under other kinds).
    """

    calls: int = 0
    payload_bytes: int = 0
    sent_bytes: int = 0
    unquantized_sent_bytes: int = 0


@dataclass
class CommStats:
    """Per-op-kind counters that tests, benchmarks and telemetry read.

    One instance is shared by a wrapped model and its optimizer, so a training step's whole
    traffic lands in one place.
    """

    ops: dict[CommOp, OpCount] = field(default_factory=lambda: {op: OpCount() for op in CommOp})

    def record(
        self,
        op: CommOp,
        payload_bytes: int,
        sent_bytes: int,
        unquantized_sent_bytes: int | None = None,
    ) -> None:
        """Count one call of `op`; `unquantized_sent_bytes` (None: `sent_bytes`) is what it
        would have sent unquantized (see [Note: unquantized bytes])."""
        count = self.ops[op]
        count.calls += 1
        count.payload_bytes += payload_bytes
        count.sent_bytes += sent_bytes
        count.unquantized_sent_bytes += (
            sent_bytes if unquantized_sent_bytes is None else unquantized_sent_bytes
        )

    def calls(self, op: CommOp) -> int:
        return self.ops[op].calls

    def sent_bytes(self, op: CommOp | None = None) -> int:
        """Bytes one rank sent for `op`, or for all ops when `op` is None."""
        if op is not None:
            return self.ops[op].sent_bytes
        return sum(count.sent_bytes for count in self.ops.values())

    def payload_bytes(self, op: CommOp) -> int:
        return self.ops[op].payload_bytes

    def unquantized_sent_bytes(self, op: CommOp | None = None) -> int:
        """What one rank would have sent for `op` (all ops when None) in the unquantized wire
        formats (see [Note: unquantized bytes])."""
        if op is not None:
            return self.ops[op].unquantized_sent_bytes
        return sum(count.unquantized_sent_bytes for count in self.ops.values())

    def reset(self) -> None:
        for op in CommOp:
            self.ops[op] = OpCount()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain-dict copy, e.g. {"all_gather": {"calls": 3, "payload_bytes": .., ...}}."""
        return {
            op.value: {
                "calls": count.calls,
                "payload_bytes": count.payload_bytes,
                "sent_bytes": count.sent_bytes,
                "unquantized_sent_bytes": count.unquantized_sent_bytes,
            }
            for op, count in self.ops.items()
        }
