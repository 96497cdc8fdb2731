"""Routing of parameter gradients into chunks and their reduction in a fixed order.

[Note: why chunks are reduced in a fixed order]
Collectives are matched by call order on every rank. If each rank reduced a chunk as soon as its
own gradients were ready, a parameter used on one rank but not another (an unused branch, an
unrouted expert) would make the ranks issue reduce-scatters in different orders and mix up or
hang. So chunks are reduced in one order shared by all ranks: a ready chunk waits for the
chunks before it, and whatever is still unreduced when backward ends is reduced then, in the
same order, with zeros for gradients that never came.

The order matters for memory: a chunk early in the order whose gradients come late (or never,
for an unused branch) holds back every later chunk's gradient buffer (and at stage 3 its
gathered parameters) until backward ends. It starts as descending chunk id, or as the reverse
of the forward order when stage 3 has recorded one, and after the first synchronised backward
becomes the order in which chunks actually completed there, rank 0's, broadcast to all ranks
(chunks that never completed go last), as DDP rebuilds its buckets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardwise import comm
from shardwise.chunk import Chunk, ChunkManager


class GradReducer:
    """Copies each parameter's gradient into its chunk as soon as autograd has accumulated it,
    and reduces chunks over ranks.

    Args:
        chunk_manager: the chunks holding the parameters.
        reduce_in_backward: reduce each chunk during backward once its gradients are complete
            (stages 2 and 3); otherwise gradients accumulate unreduced in the chunks' full
            buffers until `reduce_all()` (stage 1).
        overlap: launch those reductions asynchronously and wait for them when backward ends,
            so communication runs while backward computes.
        max_in_flight: with `overlap`, wait for the oldest reduction once more than this many
            are running (None: wait only when backward ends). Stage 3 keeps a chunk gathered
            until its reduction is done, so there this bounds the memory overlap costs.
        bucket_bytes: gather consecutive chunks into one reduce-scatter until their gradients
            reach this many bytes (0: one reduce-scatter per chunk).
        on_reduced: called with each chunk right after it is reduced (stage 3 frees its
            payload there).
        after_grad: called when a gradient copy allocated a chunk's gradient buffer (the
            memory budget check: the only moment backward's model-state bytes grow).
    """

    def __init__(
        self,
        chunk_manager: ChunkManager,
        *,
        reduce_in_backward: bool,
        overlap: bool = False,
        max_in_flight: int | None = None,
        bucket_bytes: int = 0,
        on_reduced: Callable[[Chunk], None] | None = None,
        after_grad: Callable[[str], None] | None = None,
    ) -> None:
        self.chunk_manager = chunk_manager
        self.reduce_in_backward = reduce_in_backward
        self.overlap = overlap
        self.max_in_flight = max_in_flight
        self.bucket_bytes = bucket_bytes
        self._bucket: list[Chunk] = []
        self._bucket_filled = 0
        self._in_flight: list[Chunk] = []
        self.require_sync = True
        self._on_reduced = on_reduced
        self._after_grad = after_grad
        # Descending chunk id: see [Note: why chunks are reduced in a fixed order].
        self._order = sorted(chunk_manager.trainable_chunks(), key=lambda c: -c.chunk_id)
        self._order_settled = False
        self._completed: list[int] = []
        self._next = 0
        self._complete: set[int] = set()
        self._callback_queued = False
        self._unreduced_passes = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for chunk in self._order:
            for index, info in enumerate(chunk.tensors):
                if info.param.requires_grad:
                    self._handles.append(
                        info.param.register_post_accumulate_grad_hook(self._grad_hook(chunk, index))
                    )

    def _grad_hook(self, chunk: Chunk, index: int) -> Callable[[nn.Parameter], None]:
        def hook(param: nn.Parameter) -> None:
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            assert param.grad is not None
            allocates = chunk.grad_full is None
            complete = chunk.add_grad(index, param.grad)
            # The chunk now holds the gradient; dropping .grad frees the per-parameter copy
            # (stage 1 shows a view of the chunk's copy instead).
            param.grad = chunk.exposed_grad(index)
            if allocates and self._after_grad is not None:
                self._after_grad(f"after the gradient of {chunk.tensors[index].name}")
            if complete:
                self._complete.add(chunk.chunk_id)
                self._completed.append(chunk.chunk_id)
                if self.reduce_in_backward and self.require_sync:
                    self._reduce_ready_in_order()
                elif self.reduce_in_backward and self._on_reduced is not None:
                    # Under no_sync the gradients stay whole in the chunk and nothing is
                    # reduced, but backward needs the chunk's parameters no more all the same.
                    self._on_reduced(chunk)

        return hook

    def suggest_order(self, chunk_ids: list[int]) -> None:
        """Reduce in this order until the first backward has shown the real one; every rank
        must pass the same list (stage 3's recorded forward order, reversed)."""
        if self._order_settled:
            return
        position = {chunk_id: i for i, chunk_id in enumerate(chunk_ids)}
        self._order.sort(key=lambda c: position.get(c.chunk_id, len(position)))

    def _settle_order(self) -> None:
        by_id = {chunk.chunk_id: chunk for chunk in self._order}
        seen = list(dict.fromkeys(c for c in self._completed if c in by_id))
        rest = [chunk.chunk_id for chunk in self._order if chunk.chunk_id not in set(seen)]
        # On the chunks' device: NCCL only moves device tensors.
        order = torch.tensor(seen + rest, dtype=torch.int64, device=self.chunk_manager.device)
        comm.broadcast(order, 0, self.chunk_manager.stats, self.chunk_manager.group)
        self._order = [by_id[chunk_id] for chunk_id in order.tolist()]
        self._order_settled = True

    def _reduce_ready_in_order(self) -> None:
        while self._next < len(self._order) and self._order[self._next].chunk_id in self._complete:
            self._reduce(self._order[self._next])
            self._next += 1

    def _reduce(self, chunk: Chunk) -> None:
        if self.bucket_bytes > 0:
            self._bucket.append(chunk)
            self._bucket_filled += chunk.padded_numel * chunk.dtypes.reduce.itemsize
            if self._bucket_filled >= self.bucket_bytes:
                self._flush_bucket()
            return
        chunk.start_reduce()
        if not self.overlap:
            self._finish(chunk)
            return
        self._in_flight.append(chunk)
        while self.max_in_flight is not None and len(self._in_flight) > self.max_in_flight:
            self._finish(self._in_flight.pop(0))

    def _flush_bucket(self) -> None:
        """One reduce-scatter for every chunk in the bucket: the input is laid out rank-major
        (every chunk's slice for rank 0, then for rank 1, ...), so each rank receives its own
        slice of every chunk, back to back."""
        chunks, self._bucket, self._bucket_filled = self._bucket, [], 0
        if not chunks:
            return
        world = chunks[0].world_size
        rows = [c.prepare_reduce().view(world, c.shard_numel) for c in chunks]
        stacked = torch.cat(rows, dim=1).reshape(-1)
        _, reduced = comm.reduce_to_shard(
            stacked, chunks[0].reduce_method, self.chunk_manager.stats, self.chunk_manager.group
        )
        offset = 0
        for chunk in chunks:
            chunk.accept_reduced(reduced[offset : offset + chunk.shard_numel], keep_full=False)
            offset += chunk.shard_numel
            if self._on_reduced is not None:
                self._on_reduced(chunk)

    def _finish(self, chunk: Chunk) -> None:
        chunk.finish_reduce(keep_full=False)
        if self._on_reduced is not None:
            self._on_reduced(chunk)

    def finish_in_flight(self) -> None:
        """Wait for every reduction in flight now: the memory manager needs the room their
        gathered chunks and gradient buffers hold. Only waits: no rank issues a collective
        another does not."""
        while self._in_flight:
            self._finish(self._in_flight.pop(0))

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self.reduce_in_backward and self.require_sync:
            for chunk in self._order[self._next :]:
                self._reduce(chunk)
            self._flush_bucket()
            for chunk in self._in_flight:
                self._finish(chunk)
            self._in_flight.clear()
            if not self._order_settled:
                self._settle_order()
        else:
            for chunk in self._order:
                chunk.end_pass_without_reduce()
            self._unreduced_passes = True
        self._next = 0
        self._complete.clear()
        self._completed.clear()

    def reduce_all(self) -> None:
        """Reduce the gradients that backward passes left unreduced (every pass in stage 1,
        passes under no_sync otherwise), every chunk in the fixed order. Whether anything is
        left depends only on the passes run, which every rank runs alike, so all ranks agree."""
        if not self._unreduced_passes:
            return
        for chunk in self._order:
            chunk.reduce_grads(keep_full=not self.reduce_in_backward)
            if self._on_reduced is not None:
                self._on_reduced(chunk)
        self._unreduced_passes = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
