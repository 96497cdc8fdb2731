"""The one way chunks' gradients are reduced over ranks: one chunk, or a bucket of several in a
single collective.

[Note: one reduction entry point]
A chunk reduces its gradient buffer in place; a bucket of chunks is reduced in one
reduce-scatter whose input is laid out rank-major (every chunk's slice for rank 0, then for
rank 1, ...), so each rank receives its own slice of every chunk, back to back. Either way the
chunk prepares its buffer (`prepare_reduce`) and takes its reduced slice (`accept_reduced`,
which finishes the average and, under hybrid sharding, the all-reduce across shard groups);
launching and waiting happen here only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise import comm
from shardwise.chunk.chunk import Chunk


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
