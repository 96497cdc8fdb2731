"""LinearWarmupLR (ColossalAI's `colossalai/nn/lr_scheduler/linear.py`)."""

from __future__ import annotations

from typing import Any

import torch

from shardwise.nn.lr_scheduler.schedule import ClosedFormLR, note_ignored


class LinearWarmupLR(ClosedFormLR):
    """A linear rise as (step + 1) / (warmup_steps + 1) of the base rate over `warmup_steps`,
    then a linear fall as (total_steps - step) / (total_steps - warmup_steps), reaching 0 at
    `total_steps` (ColossalAI's formula; see [Note: ColossalAI's warmup]).

    Args:
        optimizer: the optimizer.
        total_steps: steps of the whole schedule.
        warmup_steps: steps of the rise.
        last_epoch: the step to resume after (-1: start).
        **kwargs: ignored, as ColossalAI ignores them (logged).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        if not 0 <= warmup_steps < total_steps:
            raise ValueError(
                f"warmup_steps must be in [0, total_steps={total_steps}), got {warmup_steps}"
            )
        note_ignored(type(self).__name__, kwargs)
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1) * base_lr
        return (self.total_steps - step) / (self.total_steps - self.warmup_steps) * base_lr
