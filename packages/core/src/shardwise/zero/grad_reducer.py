"""Routing of parameter gradients into chunks and their reduction in a fixed order.

[Note: why chunks are reduced in a fixed order]
Collectives are matched by call order on every rank. If each rank reduced a chunk as soon as its
own gradients were ready, a parameter used on one rank but not another (an unused branch, an
unrouted expert) would make the ranks issue reduce-scatters in different orders and mix up or
hang. So chunks are reduced in descending chunk id (roughly the order backward produces them):
a ready chunk waits for the chunks before it, and whatever is still unreduced when backward
ends is reduced then, in the same order, with zeros for gradients that never came.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

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
        on_reduced: called with each chunk right after it is reduced (stage 3 frees its
            payload there).
        on_backward_end: called once after every backward pass, after all reductions.
    """

    def __init__(
        self,
        chunk_manager: ChunkManager,
        *,
        reduce_in_backward: bool,
        overlap: bool = False,
        on_reduced: Callable[[Chunk], None] | None = None,
        on_backward_end: Callable[[], None] | None = None,
    ) -> None:
        self.chunk_manager = chunk_manager
        self.reduce_in_backward = reduce_in_backward
        self.overlap = overlap
        self._in_flight: list[Chunk] = []
        self.require_sync = True
        self._on_reduced = on_reduced
        self._on_backward_end = on_backward_end
        # Descending chunk id: see [Note: why chunks are reduced in a fixed order].
        self._order = sorted(chunk_manager.trainable_chunks(), key=lambda c: -c.chunk_id)
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
            complete = chunk.add_grad(index, param.grad)
            # The chunk now holds the gradient; dropping .grad frees the per-parameter copy.
            param.grad = None
            if complete:
                self._complete.add(chunk.chunk_id)
                if self.reduce_in_backward and self.require_sync:
                    self._reduce_ready_in_order()

        return hook

    def _reduce_ready_in_order(self) -> None:
        while self._next < len(self._order) and self._order[self._next].chunk_id in self._complete:
            self._reduce(self._order[self._next])
            self._next += 1

    def _reduce(self, chunk: Chunk) -> None:
        chunk.start_reduce()
        if self.overlap:
            self._in_flight.append(chunk)
        else:
            self._finish(chunk)

    def _finish(self, chunk: Chunk) -> None:
        chunk.finish_reduce(keep_full=False)
        if self._on_reduced is not None:
            self._on_reduced(chunk)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self.reduce_in_backward and self.require_sync:
            for chunk in self._order[self._next :]:
                self._reduce(chunk)
            for chunk in self._in_flight:
                self._finish(chunk)
            self._in_flight.clear()
        else:
            for chunk in self._order:
                chunk.end_pass_without_reduce()
            self._unreduced_passes = True
        self._next = 0
        self._complete.clear()
        if self._on_backward_end is not None:
            self._on_backward_end()

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
