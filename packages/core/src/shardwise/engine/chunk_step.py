"""The inner optimizer stepping one chunk's shard views (see [Note: the step, chunk by chunk]
in engine/optimizer.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise.chunk import Chunk
from shardwise.optim import HybridAdam


class ChunkStepper:
    """Steps `optim` over one chunk's views at a time.

    Args:
        optim: the user's optimizer, its param groups holding every shard view.
        slots: per chunk id, each view with its range in the chunk's gradient shard and its
            tensor's position among the optimizer's trainable tensors.
        groups_of_chunk: per chunk id, its views in each param group (absent where this rank
            owns no element of the chunk).
    """

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        slots: dict[int, list[tuple[torch.Tensor, int, int, int]]],
        groups_of_chunk: dict[int, list[list[torch.Tensor]]],
    ) -> None:
        self.optim = optim
        self.slots = slots
        self.groups_of_chunk = groups_of_chunk

    def step(
        self,
        chunk: Chunk,
        grad: torch.Tensor,
        coef: float,
        got_grad: Sequence[bool] | None = None,
    ) -> None:
        """Show each view its part of `grad` (None where `got_grad`, per position, says no
        rank's gradient reached its tensor: see [Note: tensors without gradients] in
        engine/optimizer.py; every view where it is None), step the optimizer over the
        chunk's views alone with the gradient times `coef`, and let the chunk adopt the state
        it made or replaced (see [Note: the chunk owns its optimizer state] in
        chunk/optimizer_state.py). The param groups hold every view again afterwards, also
        when the step raises."""
        for view, begin, end, position in self.slots[chunk.chunk_id]:
            reached = got_grad is None or got_grad[position]
            view.grad = grad[begin:end] if reached else None
        views = self.groups_of_chunk.get(chunk.chunk_id)
        if views is None:  # no element of this chunk is this rank's to step
            return
        groups = self.optim.param_groups
        whole = [group["params"] for group in groups]
        try:
            for group, chunk_views in zip(groups, views, strict=True):
                group["params"] = chunk_views
            states = chunk.optimizer_state
            states.adopt(self.optim.state.get(view, {}) for view, _, _ in states.views)
            if isinstance(self.optim, HybridAdam):
                # Unscaled and clipped inside the fused update: no separate pass over
                # gradients.
                self.optim.step(grad_scale=1.0 / coef)
            else:
                if coef != 1.0:
                    grad.mul_(coef)
                self.optim.step()
            states.adopt(self.optim.state.get(view, {}) for view, _, _ in states.views)
        finally:
            for group, params in zip(groups, whole, strict=True):
                group["params"] = params


__all__ = ["ChunkStepper"]
