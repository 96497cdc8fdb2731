"""The one way chunks' gradients are reduced over ranks: one chunk, or a bucket of several in a
single collective.

[Note: one reduction entry point]
A chunk reduces its gradient buffer in place; a bucket of chunks is reduced in one
reduce-scatter whose input is laid out rank-major (every chunk's slice for rank 0, then for
rank 1, ...), so each rank receives its own slice of every chunk, back to back. Either way the
chunk prepares its buffer (`prepare_reduce`) and takes its reduced slice (`accept_reduced`,
which finishes the average over the group); launching and waiting happen here only.

Under hybrid sharding the shard groups' gradient shards are then averaged across the groups by
`reduce_across_replicas`, once before the step reads them (and before `full_grads()`), not
after every reduction: every rank reaches that point alike whatever its memory manager did
during backward, and gradients accumulated over several backward passes cross the groups once.
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
        self, chunks: Sequence[Chunk], work: comm.Waitable | None, reduced: torch.Tensor
    ) -> None:
        self.chunks = list(chunks)
        self._work = work
        self._reduced = reduced

    def wait(self, *, keep_full: bool) -> list[Chunk]:
        """Wait for the collective and hand each chunk its slice; the chunks, in order."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        offset = 0
        for chunk in self.chunks:
            chunk.accept_reduced(
                self._reduced[offset : offset + chunk.shard_numel], keep_full=keep_full
            )
            offset += chunk.shard_numel
        return self.chunks


def start_reduction(chunks: Sequence[Chunk], *, async_op: bool = True) -> PendingReduction:
    """Launch the reduction of `chunks`' gradients (one collective for all of them). They must
    share the group, the reduction method and the reduction dtype, as one manager's do."""
    if not chunks:
        raise ValueError("nothing to reduce: start_reduction needs at least one chunk")
    first = chunks[0]
    if len(chunks) == 1:
        full = first.prepare_reduce()
    else:
        rows = [c.prepare_reduce().view(c.world_size, c.shard_numel) for c in chunks]
        full = torch.cat(rows, dim=1).reshape(-1)
    work, reduced = comm.reduce_to_shard(
        full, first.reduce_method, first.stats, first.group, async_op=async_op
    )
    return PendingReduction(chunks, work, reduced)


def reduce_now(chunks: Sequence[Chunk], *, keep_full: bool) -> None:
    """Reduce `chunks`' gradients and add each rank's averaged slices to their shards."""
    start_reduction(chunks, async_op=False).wait(keep_full=keep_full)


def reduce_across_replicas(chunk_manager: ChunkManager) -> None:
    """Hybrid sharding: average every trainable chunk's gradient shard over the shard groups
    holding the same shard, in one all-reduce in the reduction dtype (the bytes the analysis
    of [Note: hybrid sharding] counts). Values already equal on every replica stay as they are,
    so a second call before new gradients changes nothing but rounding."""
    topology = chunk_manager.topology
    chunks = list(chunk_manager.trainable_chunks())
    if topology.replicate is None or not chunks:
        return
    if any(c.grad_layout is GradLayout.IN_PAYLOAD for c in chunks):
        raise ValueError(
            "reuse_fp16_shard keeps gradients in the 16-bit payload; it cannot be combined "
            "with shard_size (hybrid sharding)"
        )
    shards = [chunk.grads_for_step() for chunk in chunks]
    # Divided before the sum (exactly, for a power-of-two count), so that a 16-bit sum of
    # loss-scaled gradients cannot overflow where the average would not; then sent on the
    # compute device (NCCL moves device tensors only), in the reduction dtype.
    flat = torch.cat([s.to(chunk_manager.device) for s in shards]).div_(topology.replicas)
    wire = flat.to(chunks[0].dtypes.reduce)
    comm.all_reduce(
        wire, chunk_manager.stats, topology.replicate, kind=comm.CommOp.REPLICATE_ALL_REDUCE
    )
    wire = wire.float()
    offset = 0
    for shard in shards:
        shard.copy_(wire[offset : offset + shard.numel()])
        offset += shard.numel()
