"""The gather side of a chunk's wire: what its parameter all-gathers send, where they receive,
and how the buffer the parameters compute with is filled from what arrived (see [Note: wire
formats] in formats.py).

Every all-gather of a chunk's payload (stage 3 before a module runs, from the primary shards
or from hpZ's secondary copies; stages 1-2 after the step) starts with `start` or
`start_from_secondary` and is completed by `finish` once the collective is done; a prefetch
nobody used is dropped with `discard`. The payload (chunk/payload.py) owns the gathered buffer
`full` and the compute buffer the parameters view; the gather side owns what only travels: its
send and receive buffers (`allocate`), and, for hpZ, the part of the last gather it keeps for
backward. The unquantized gather has none of its own: it receives straight into `full`, which
the parameters view (or which is cast into their compute copy), so it adds no copy.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise import comm
from shardwise.chunk.resident import Resident
from shardwise.chunk.states import ChunkDtypes
from shardwise.comm import CommOp, CommStats
from shardwise.comm.quantize import BlockQuantizer


class GatherWire(Protocol):
    """One chunk's parameter all-gathers, with their buffers."""

    @property
    def receives_into_full(self) -> bool:
        """Whether the collective's output is the payload's gathered buffer `full` (which the
        payload allocates before `start`); otherwise the gather side receives into a buffer
        of its own and `finish` fills the compute buffer from it."""
        ...

    @property
    def restores_own_slice(self) -> bool:
        """Whether `finish` writes this rank's own slice from its shard, which the caller
        must then pass to `start_from_secondary`."""
        ...

    def start(
        self, shard: torch.Tensor, full: torch.Tensor, group: ProcessGroup | None, *, async_op: bool
    ) -> dist.Work | None:
        """Launch the all-gather of every rank's `shard` (on the device) over `group`, counted
        as an all-gather; `finish` completes it once the returned work is done."""
        ...

    def start_from_secondary(
        self,
        secondary: torch.Tensor,
        full: torch.Tensor,
        group: ProcessGroup | None,
        own: torch.Tensor | None,
        *,
        async_op: bool,
    ) -> dist.Work | None:
        """Launch the all-gather of the secondary copies (`secondary_copy`) over hpZ's
        secondary `group`, counted as a secondary all-gather; `own` is this rank's shard on
        the device where `restores_own_slice`."""
        ...

    def finish(self, full: torch.Tensor, compute: torch.Tensor) -> None:
        """Fill `compute` (the buffer the parameters view: `full` itself, or its compute copy,
        allocated) from the completed gather, and drop the buffers it used."""
        ...

    def discard(self) -> None:
        """Drop what a completed gather that nobody will finish holds."""
        ...

    def secondary_copy(
        self, full: torch.Tensor, compute: torch.Tensor, begin: int, span: int
    ) -> torch.Tensor:
        """hpZ: what this rank keeps for backward's gather from the gathered chunk, elements
        [begin, begin + span) of it, in the form `start_from_secondary` sends."""
        ...

    def drop_kept(self) -> None:
        """Forget what was kept for a secondary copy that will not be made."""
        ...

    def held_bytes(self) -> int:
        """Device bytes of the gather side's own buffers now."""
        ...

    def gathered_nbytes(self, padded_numel: int) -> int:
        """Device bytes a gather of a chunk of `padded_numel` elements allocates: the
        payload's buffers it fills and the gather side's own."""
        ...


class PayloadGather:
    """The payload is sent as stored and received into the gathered buffer, which the
    parameters view, or which is cast into their compute copy of `dtypes.compute`.

    Args:
        dtypes: the chunk's dtypes.
        stats: collective counters.
    """

    receives_into_full = True
    restores_own_slice = False

    def __init__(self, dtypes: ChunkDtypes, stats: CommStats) -> None:
        self._dtypes = dtypes
        self._stats = stats

    def start(
        self, shard: torch.Tensor, full: torch.Tensor, group: ProcessGroup | None, *, async_op: bool
    ) -> dist.Work | None:
        return comm.all_gather(full, shard, self._stats, group, async_op=async_op)

    def start_from_secondary(
        self,
        secondary: torch.Tensor,
        full: torch.Tensor,
        group: ProcessGroup | None,
        own: torch.Tensor | None,
        *,
        async_op: bool,
    ) -> dist.Work | None:
        return comm.all_gather(
            full,
            secondary,
            self._stats,
            group,
            async_op=async_op,
            kind=CommOp.SECONDARY_ALL_GATHER,
        )

    def finish(self, full: torch.Tensor, compute: torch.Tensor) -> None:
        if compute is not full:
            compute.copy_(full)

    def discard(self) -> None:
        pass

    def secondary_copy(
        self, full: torch.Tensor, compute: torch.Tensor, begin: int, span: int
    ) -> torch.Tensor:
        # A payload cast into a compute copy is freed after the cast; that slice of the copy,
        # cast back to the payload dtype, decodes into the same compute values again (for a
        # 16-bit payload computed in fp32 it is the payload itself: the cast up was exact).
        return compute[begin : begin + span].to(self._dtypes.payload, copy=True)

    def drop_kept(self) -> None:
        pass

    def held_bytes(self) -> int:
        return 0

    def gathered_nbytes(self, padded_numel: int) -> int:
        nbytes = padded_numel * _element_size(self._dtypes.payload)
        if self._dtypes.compute != self._dtypes.payload:
            nbytes += padded_numel * _element_size(self._dtypes.compute)
        return nbytes


class QuantizedGather:
    """qwZ: each rank sends its shard as one record of one-byte values and per-block scales
    (see [Note: blockwise quantization] in comm/quantize.py), and every rank decodes the
    others' records into the compute buffer; its own slice there is its shard, exactly (see
    [Note: quantized gathers] in formats.py).

    Args:
        quantizer: the block format.
        dtypes: the chunk's dtypes.
        stats: collective counters.
        group: the group the chunk is sharded over.
        secondary_group: hpZ's secondary group, or None.
        owner: the chunk whose resident bytes these buffers count in (see [Note: resident
            changes] in chunk/resident.py).
    """

    receives_into_full = False
    restores_own_slice = True

    sent = Resident[torch.Tensor | None](transient=True)
    """This rank's record, from `start` until the gather is finished."""
    received = Resident[torch.Tensor | None](transient=True)
    """Every rank's record, in rank order, from `start` until the gather is finished."""
    kept = Resident[torch.Tensor | None](transient=True)
    """hpZ: the records of this rank's secondary span, from a finished gather until the
    release that makes them the secondary copy, or drops them."""

    def __init__(
        self,
        quantizer: BlockQuantizer,
        dtypes: ChunkDtypes,
        stats: CommStats,
        group: ProcessGroup | None,
        secondary_group: ProcessGroup | None,
        owner: Any,
    ) -> None:
        self.__dict__["_resident_owner"] = owner
        self.quantizer = quantizer
        self._dtypes = dtypes
        self._stats = stats
        self._world = comm.world_size(group)
        self._rank = comm.rank(group)
        # hpZ: the secondary group's ranks each keep 1/s of the records (consecutive ranks:
        # see comm/topology.py's `secondary_group`), so their gather is the primary's rows.
        self._secondary_rows: slice | None = None
        if secondary_group is not None:
            rows = self._world // comm.world_size(secondary_group)
            first = comm.rank(secondary_group) * rows
            self._secondary_rows = slice(first, first + rows)
        self.sent = None
        self.received = None
        self.kept = None
        self._own: torch.Tensor | None = None

    def start(
        self, shard: torch.Tensor, full: torch.Tensor, group: ProcessGroup | None, *, async_op: bool
    ) -> dist.Work | None:
        record_nbytes = self.quantizer.record_nbytes(shard.numel())
        self.sent = self.quantizer.encode(shard, self.allocate(record_nbytes, shard.device))
        self.received = self.allocate(self._world * record_nbytes, shard.device)
        self._own = shard
        return comm.all_gather(
            self.received,
            self.sent,
            self._stats,
            group,
            async_op=async_op,
            unquantized_payload_bytes=self._unquantized_nbytes(shard.numel()),
        )

    def start_from_secondary(
        self,
        secondary: torch.Tensor,
        full: torch.Tensor,
        group: ProcessGroup | None,
        own: torch.Tensor | None,
        *,
        async_op: bool,
    ) -> dist.Work | None:
        assert own is not None, "a quantized gather writes this rank's own slice from its shard"
        self.received = self.allocate(
            self._world * self.quantizer.record_nbytes(own.numel()), own.device
        )
        self._own = own
        return comm.all_gather(
            self.received,
            secondary.view(-1),
            self._stats,
            group,
            async_op=async_op,
            kind=CommOp.SECONDARY_ALL_GATHER,
            unquantized_payload_bytes=self._unquantized_nbytes(own.numel()),
        )

    def _unquantized_nbytes(self, shard_numel: int) -> int:
        """The gathered buffer `PayloadGather` would receive: every rank's shard in the
        payload dtype (see [Note: unquantized bytes] in comm/stats.py)."""
        return self._world * shard_numel * _element_size(self._dtypes.payload)

    def finish(self, full: torch.Tensor, compute: torch.Tensor) -> None:
        received, own = self.received, self._own
        assert received is not None and own is not None, "finish without a gather"
        records = received.view(self._world, -1)
        rows = compute.view(self._world, -1)
        me = self._rank
        # Every record but this rank's own, which is its shard exactly.
        for others in (slice(0, me), slice(me + 1, self._world)):
            if others.stop > others.start:
                self.quantizer.decode(records[others], rows[others])
        if rows[me].data_ptr() != own.data_ptr():  # a kept payload's shard is its slice
            rows[me].copy_(own)
        if self._secondary_rows is not None:
            self.kept = records[self._secondary_rows].clone()
        self.discard()

    def discard(self) -> None:
        self.sent = None
        self.received = None
        self._own = None

    def secondary_copy(
        self, full: torch.Tensor, compute: torch.Tensor, begin: int, span: int
    ) -> torch.Tensor:
        # [Note: quantized gathers and hpZ] in formats.py: the records forward received, so
        # backward decodes the very values forward computed with.
        kept = self.kept
        assert kept is not None, "a secondary copy needs a finished gather"
        self.kept = None
        return kept

    def drop_kept(self) -> None:
        if self.kept is not None:
            self.kept = None

    def held_bytes(self) -> int:
        return sum(
            0 if buffer is None else buffer.untyped_storage().size()
            for buffer in (self.sent, self.received, self.kept)
        )

    def gathered_nbytes(self, padded_numel: int) -> int:
        record_nbytes = self.quantizer.record_nbytes(padded_numel // self._world)
        # The compute buffer (the payload itself when the dtypes agree) and both records.
        return (
            padded_numel * _element_size(self._dtypes.compute) + (self._world + 1) * record_nbytes
        )

    @staticmethod
    def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
        """A send or receive buffer of `nbytes` bytes on `device` (records are bytes)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
