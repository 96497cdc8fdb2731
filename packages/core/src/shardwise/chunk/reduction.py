"""The one way chunks' gradients are reduced over ranks: one chunk, or a bucket of several in a
single collective.

[Note: one reduction entry point]
A chunk reduces its gradient buffer in place; a bucket of chunks is reduced in one
reduce-scatter whose input is laid out rank-major (every chunk's slice for rank 0, then for
rank 1, ...), so each rank receives its own slice of every chunk, back to back. Either way the
chunk prepares its buffer (`prepare_reduce`) and takes its reduced slice (`accept_reduced`,
which finishes the average over the group); launching and waiting happen here only, and the
sums themselves on the reduce side of the (first) chunk's wire, in its format (see [Note: wire
formats] in chunk/wire/formats.py).

Under hybrid sharding the shard groups' gradient shards are then averaged across the groups by
`reduce_across_replicas`, once before the step reads them (and before `full_grads()`), not
after every reduction: every rank reaches that point alike whatever its memory manager did
during backward, and gradients accumulated over several backward passes cross the groups once.

[Note: stage 0]
ColoDDP shards nothing: its shard group is this rank alone and every other rank is a replica
(`replicated()` in comm/topology.py), so there is nothing to reduce inside the group and a
chunk's reduction is its average across the replicas: the whole gradient buffer is divided by
their count and all-reduced in place (`GradLayout.WHOLE`), the chunk playing a DDP bucket's
part. Unlike hybrid sharding's, this average runs during backward, each chunk launched as soon
as it is complete in the fixed order of [Note: why chunks are reduced in a fixed order]: the
user's own optimizer reads `.grad` when backward returns, and there is no step of ours to
defer it to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise import comm
from shardwise.chunk.chunk import Chunk
from shardwise.chunk.manager import ChunkManager
from shardwise.chunk.states import GradLayout


class PendingReduction:
    """A reduction launched by `start_reduction`, not yet accepted by its chunks."""

    def __init__(
        self,
        chunks: Sequence[Chunk],
        works: Sequence[comm.Waitable | None],
        reduced: Sequence[torch.Tensor],
    ) -> None:
        self.chunks = list(chunks)
        self._works = [work for work in works if work is not None]
        self._reduced = list(reduced)  # each chunk's slice, valid once the works are done

    def wait(self, *, keep_full: bool) -> list[Chunk]:
        """Wait for the collectives and hand each chunk its slice; the chunks, in order."""
        while self._works:
            self._works.pop(0).wait()
        for chunk, reduced in zip(self.chunks, self._reduced, strict=True):
            chunk.grads.accept_reduced(reduced, keep_full=keep_full)
        return self.chunks


def start_reduction(chunks: Sequence[Chunk], *, async_op: bool = True) -> PendingReduction:
    """Launch the reduction of `chunks`' gradients (one collective for all of them; at stage 0
    one each, see [Note: stage 0]). They must share the group, the wire formats and the
    reduction dtype, as one manager's do."""
    if not chunks:
        raise ValueError("nothing to reduce: start_reduction needs at least one chunk")
    first = chunks[0]
    if first.grads.layout is GradLayout.WHOLE:
        return _start_average_of_replicas(chunks, async_op=async_op)
    if first.grads.layout is GradLayout.AVERAGED_FULL:
        return _start_average_in_place(chunks, async_op=async_op)
    if len(chunks) == 1:
        full = first.grads.prepare_reduce()
    else:
        rows = [c.grads.prepare_reduce().view(c.world_size, c.shard_numel) for c in chunks]
        full = torch.cat(rows, dim=1).reshape(-1)
    work, reduced = first.wire.reduce.start_reduce_scatter(full, async_op=async_op)
    slices = reduced.split([c.shard_numel for c in chunks])
    return PendingReduction(chunks, [work], slices)


def _start_average_of_replicas(chunks: Sequence[Chunk], *, async_op: bool) -> PendingReduction:
    """Stage 0: each chunk's whole gradient buffer all-reduced in place across its replicas,
    one collective per chunk (see [Note: stage 0])."""
    works: list[comm.Waitable | None] = []
    buffers = []
    for chunk in chunks:
        assert chunk.grads.layout is GradLayout.WHOLE, "a bucket mixes stage 0 with sharding"
        buffer = chunk.grads.prepare_reduce()
        buffers.append(buffer)
        if chunk.replicate_group is None:  # a single rank: nothing to average
            continue
        replicas = comm.world_size(chunk.replicate_group)
        if replicas > 1:
            # Divided before the sum, as DDP does (exactly, for a power-of-two count).
            buffer.div_(replicas)
        works.append(
            chunk.wire.reduce.start_sum_over_replicas(
                buffer, kind=comm.CommOp.ALL_REDUCE, async_op=async_op
            )
        )
    return PendingReduction(chunks, works, buffers)


def _start_average_in_place(chunks: Sequence[Chunk], *, async_op: bool) -> PendingReduction:
    """Stage 1 (`GradLayout.AVERAGED_FULL`): each chunk's whole gradient buffer summed over
    its group in place, one collective per chunk (see [Note: stage 1 averages in backward] in
    chunk/grads.py), by the wire's `start_sum`."""
    works: list[comm.Waitable | None] = []
    buffers = []
    for chunk in chunks:
        assert chunk.grads.layout is GradLayout.AVERAGED_FULL, "a bucket mixes layouts"
        full = chunk.grads.prepare_reduce()
        buffers.append(full)
        works.append(chunk.wire.reduce.start_sum(full, async_op=async_op))
    return PendingReduction(chunks, works, buffers)


def reduce_now(chunks: Sequence[Chunk], *, keep_full: bool) -> None:
    """Reduce `chunks`' gradients and add each rank's averaged slices to their shards."""
    start_reduction(chunks, async_op=False).wait(keep_full=keep_full)


def reduce_across_replicas(chunk_manager: ChunkManager) -> None:
    """Hybrid sharding: average every trainable chunk's gradient shard over the shard groups
    holding the same shard, in one all-reduce in the reduction dtype (the bytes the analysis
    of [Note: hybrid sharding] counts). Values already equal on every replica stay as they are,
    so a second call before new gradients changes nothing but rounding."""
    topology = chunk_manager.topology
    # Stage 0's chunks were averaged across the replicas in backward (see [Note: stage 0]).
    chunks = [c for c in chunk_manager.trainable_chunks() if c.grads.layout is not GradLayout.WHOLE]
    if topology.replicate is None or not chunks:
        return
    if any(c.grads.layout is GradLayout.IN_PAYLOAD for c in chunks):
        raise ValueError(
            "reuse_fp16_shard keeps gradients in the 16-bit payload; it cannot be combined "
            "with shard_size (hybrid sharding)"
        )
    shards = [chunk.grads.for_step() for chunk in chunks]
    for chunk in chunks:
        chunk.grads.norm_partial = None  # the shards change (see [Note: norm partials])
    # Divided before the sum (exactly, for a power-of-two count), so that a 16-bit sum of
    # loss-scaled gradients cannot overflow where the average would not; then sent on the
    # compute device (NCCL moves device tensors only), in the reduction dtype.
    flat = torch.cat([s.to(chunk_manager.device) for s in shards]).div_(topology.replicas)
    wire = flat.to(chunks[0].dtypes.reduce)
    chunks[0].wire.reduce.start_sum_over_replicas(
        wire, kind=comm.CommOp.REPLICATE_ALL_REDUCE, async_op=False
    )
    wire = wire.float()
    offset = 0
    for shard in shards:
        shard.copy_(wire[offset : offset + shard.numel()])
        offset += shard.numel()
