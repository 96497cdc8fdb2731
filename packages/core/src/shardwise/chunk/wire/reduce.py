"""The reduce side of a chunk's wire: how a gradient buffer is summed over ranks, and the
buffers that receives it (see [Note: wire formats] in formats.py).

chunk/reduction.py prepares the buffer (one chunk's, or a bucket's laid out rank-major) and
hands the chunks their slices; the reduce side only sums. Three sums, one per place gradients
cross ranks:
- `start_reduce_scatter`: over the shard group, each rank keeping its slice (stages 1-3);
- `start_sum`: over the shard group, every rank keeping the whole sum in place (stage 1 where
  it averages in backward for `.grad`: see [Note: stage 1 averages in backward] in
  chunk/grads.py);
- `sum_over_replicas` / `start_sum_over_replicas`: over the replicate group, in place (hybrid
  sharding once per step, stage 0 per chunk in backward: see [Note: one reduction entry point]
  and [Note: stage 0] in chunk/reduction.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise import comm
from shardwise.comm import CommOp, CommStats, ReduceScatterMethod
from shardwise.comm.quantize import BlockQuantizer


class ReduceWire(Protocol):
    """One chunk's gradient reductions, with their receive buffers."""

    def start_reduce_scatter(
        self, full: torch.Tensor, *, async_op: bool
    ) -> tuple[comm.Waitable | None, torch.Tensor]:
        """Sum `full` over the shard group so that rank r holds the r-th of N equal slices:
        (handle, slice), the slice valid once the handle (None when already done) is waited
        for. The slice may be a view of `full`, or fp32 where the format sums in fp32."""
        ...

    def start_sum(self, full: torch.Tensor, *, async_op: bool) -> comm.Waitable | None:
        """Sum `full` over the shard group in place, every rank holding the whole sum once
        the handle is waited for."""
        ...

    def start_sum_over_replicas(
        self, buffer: torch.Tensor, *, kind: CommOp, async_op: bool
    ) -> comm.Waitable | None:
        """Sum `buffer` over the replicate group in place, counted as `kind`."""
        ...


class PayloadReduce:
    """Gradients sent in the reduce dtype they were accumulated in, reduce-scattered by
    `method` (see [Note: reduce-scatter methods] in comm/collectives.py).

    Args:
        method: how a reduce-scatter runs.
        stats: collective counters.
        group: the shard group.
        replicate_group: the replicate group (hybrid sharding, stage 0), or None.
        device: where receive buffers are made.
    """

    def __init__(
        self,
        method: ReduceScatterMethod,
        stats: CommStats,
        group: ProcessGroup | None,
        replicate_group: ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.method = method
        self._stats = stats
        self._group = group
        self._replicate_group = replicate_group
        self._device = device

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A receive buffer of `numel` elements of `dtype` on the device."""
        return torch.empty(numel, dtype=dtype, device=self._device)

    def start_reduce_scatter(
        self, full: torch.Tensor, *, async_op: bool
    ) -> tuple[comm.Waitable | None, torch.Tensor]:
        return comm.reduce_to_shard(
            full, self.method, self._stats, self._group, async_op=async_op, allocate=self.allocate
        )

    def start_sum(self, full: torch.Tensor, *, async_op: bool) -> comm.Waitable | None:
        # One all-reduce; a reduce-scatter method asked for by name is honoured as that
        # reduce-scatter followed by an all-gather of the summed slices, the two halves of one.
        work, summed = self.start_reduce_scatter(full, async_op=async_op)
        if self.method is ReduceScatterMethod.ALL_REDUCE:
            return work  # `full` itself holds the sum once it is done
        return _GatherOnWait(work, summed, full, self._stats, self._group)

    def start_sum_over_replicas(
        self, buffer: torch.Tensor, *, kind: CommOp, async_op: bool
    ) -> comm.Waitable | None:
        return comm.all_reduce(
            buffer, self._stats, self._replicate_group, async_op=async_op, kind=kind
        )


class QuantizedReduce:
    """qgZ: each rank quantizes every other rank's slice of its gradient buffer (see [Note:
    blockwise quantization] in comm/quantize.py), the slices are exchanged with one
    all-to-all, and each rank sums, in fp32, its own slice as it is and the others' decoded
    (see [Note: quantized reductions] in formats.py).

    Args:
        quantizer: the block format.
        stats: collective counters.
        group: the shard group.
        replicate_group: the replicate group (hybrid sharding), or None.
        device: where send and receive buffers are made.
    """

    def __init__(
        self,
        quantizer: BlockQuantizer,
        stats: CommStats,
        group: ProcessGroup | None,
        replicate_group: ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.quantizer = quantizer
        self._stats = stats
        self._group = group
        self._replicate_group = replicate_group
        self._device = device

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A send or receive buffer of `numel` elements of `dtype` on the device."""
        return torch.empty(numel, dtype=dtype, device=self._device)

    def start_reduce_scatter(
        self, full: torch.Tensor, *, async_op: bool
    ) -> tuple[comm.Waitable | None, torch.Tensor]:
        return self._reduce_scatter(full, self._group, CommOp.REDUCE_SCATTER, async_op=async_op)

    def start_sum(self, full: torch.Tensor, *, async_op: bool) -> comm.Waitable | None:
        # The sums come back exactly, so every rank holds the same (as `.grad` must).
        work, summed = self.start_reduce_scatter(full, async_op=async_op)
        return _GatherOnWait(work, summed, full, self._stats, self._group)

    def start_sum_over_replicas(
        self, buffer: torch.Tensor, *, kind: CommOp, async_op: bool
    ) -> comm.Waitable | None:
        # [Note: quantized reductions]: once per level, the replicas' sums back exactly; run
        # at once (hybrid sharding's is the step's, which waits for it anyway).
        group = self._replicate_group
        replicas = comm.world_size(group)
        padded = -(-buffer.numel() // replicas) * replicas
        full = buffer
        if padded != buffer.numel():
            full = torch.zeros(padded, dtype=buffer.dtype, device=buffer.device)
            full[: buffer.numel()].copy_(buffer)
        # Unquantized, one all-reduce of `buffer`: counted as its two halves, each over the
        # buffer as it is (see [Note: unquantized bytes] in comm/stats.py).
        unpadded_nbytes = buffer.numel() * buffer.element_size()
        work, summed = self._reduce_scatter(
            full, group, kind, async_op=False, unquantized_nbytes=unpadded_nbytes
        )
        assert work is None
        gathered = self.allocate(padded, buffer.dtype)
        comm.all_gather(
            gathered,
            summed.to(buffer.dtype),
            self._stats,
            group,
            kind=kind,
            unquantized_payload_bytes=unpadded_nbytes,
        )
        buffer.copy_(gathered[: buffer.numel()])
        return None

    def _reduce_scatter(
        self,
        full: torch.Tensor,
        group: ProcessGroup | None,
        kind: CommOp,
        *,
        async_op: bool,
        unquantized_nbytes: int | None = None,
    ) -> tuple[comm.Waitable | None, torch.Tensor]:
        """The all-to-all of records standing for a reduce-scatter of `full`, counted against
        `full` in its dtype unquantized (or `unquantized_nbytes`)."""
        world, me = comm.world_size(group), comm.rank(group)
        if full.numel() % world:
            raise ValueError(f"a buffer of {full.numel()} elements does not split over {world}")
        shard_numel = full.numel() // world
        slices = full.view(world, shard_numel)
        record_nbytes = self.quantizer.record_nbytes(shard_numel)
        reduced = self.allocate(shard_numel, torch.float32)
        reduced.copy_(slices[me])
        others = [rank for rank in range(world) if rank != me]
        sent = self.allocate(len(others) * record_nbytes, torch.uint8)
        for row, rank in enumerate(others):
            self.quantizer.encode(
                slices[rank], sent[row * record_nbytes : (row + 1) * record_nbytes]
            )
        received = self.allocate(len(others) * record_nbytes, torch.uint8)
        # No rank sends itself its own slice: it sums that one as it is.
        splits = [0 if rank == me else record_nbytes for rank in range(world)]
        work = comm.all_to_all(
            received,
            sent,
            self._stats,
            group,
            output_split_sizes=splits,
            input_split_sizes=splits,
            logical_bytes=world * record_nbytes,
            kind=kind,
            async_op=async_op,
            unquantized_payload_bytes=(
                full.numel() * full.element_size()
                if unquantized_nbytes is None
                else unquantized_nbytes
            ),
        )
        pending = _SumDecoded(work, self.quantizer, received.view(len(others), -1), reduced, sent)
        if async_op:
            return pending, reduced
        pending.wait()
        return None, reduced


class _SumDecoded:
    """The pending exchange of a quantized reduce-scatter: waiting adds every other rank's
    decoded slice, in rank order, to this rank's own (in `reduced`, fp32)."""

    def __init__(
        self,
        work: dist.Work | None,
        quantizer: BlockQuantizer,
        received: torch.Tensor,
        reduced: torch.Tensor,
        sent: torch.Tensor,
    ) -> None:
        self._work = work
        self._quantizer = quantizer
        self._received = received  # (N - 1, record bytes)
        self._reduced = reduced
        self._sent = sent  # held until the exchange is done

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
        self._quantizer.add_decoded(self._received, self._reduced)
        self._work = None
        return True


class _GatherOnWait:
    """A reduce-scatter whose summed slices are all-gathered back into the whole buffer when
    it is waited for (`start_sum`)."""

    def __init__(
        self,
        work: comm.Waitable | None,
        summed: torch.Tensor,
        full: torch.Tensor,
        stats: CommStats,
        group: ProcessGroup | None,
    ) -> None:
        self._work = work
        self._summed = summed
        self._full = full
        self._stats = stats
        self._group = group

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
        # A quantized reduction sums in fp32: back in the buffer's dtype (no copy otherwise).
        comm.all_gather(self._full, self._summed.to(self._full.dtype), self._stats, self._group)
        return True
