"""Step decays at milestones, with and without warmup (ColossalAI's
`colossalai/nn/lr_scheduler/multistep.py`)."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import torch
from torch.optim.lr_scheduler import MultiStepLR as _TorchMultiStepLR

from shardwise.nn.lr_scheduler.schedule import ClosedFormLR, note_ignored, warmup_factor


class MultiStepLR(_TorchMultiStepLR):
    """torch's MultiStepLR (the rate times `gamma` at each milestone), taking `total_steps`.

    Args:
        optimizer: the optimizer.
        total_steps: steps of the schedule (not used by the decay, as in ColossalAI).
        milestones: the steps the rate is multiplied by `gamma` at, increasing.
        gamma: the factor.
        last_epoch: the step to resume after (-1: start).
        **kwargs: ignored, as ColossalAI ignores them (logged).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        milestones: list[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        if milestones is None:
            raise ValueError("MultiStepLR needs milestones (the steps to decay at)")
        note_ignored(type(self).__name__, kwargs)
        super().__init__(optimizer, milestones, gamma=gamma, last_epoch=last_epoch)


class MultiStepWarmupLR(ClosedFormLR):
    """A linear warmup over `warmup_steps`, then the base rate times `gamma` for each milestone
    reached (milestones before the warmup's end are dropped, as in ColossalAI).

    Args:
        optimizer: the optimizer.
        total_steps: steps of the schedule.
        warmup_steps: steps of the warmup.
        milestones: the steps the rate is multiplied by `gamma` at, increasing, not empty.
        gamma: the factor.
        last_epoch: the step to resume after (-1: start).
        **kwargs: ignored, as ColossalAI ignores them (logged).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        milestones: list[int] | None = None,
        gamma: float = 0.1,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        if not milestones:
            raise ValueError("milestones cannot be empty")
        note_ignored(type(self).__name__, kwargs)
        self.warmup_steps, self.gamma = warmup_steps, gamma
        self.milestones = sorted(m for m in milestones if m >= warmup_steps)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        if step < self.warmup_steps:
            return warmup_factor(step, self.warmup_steps) * base_lr
        return base_lr * self.gamma ** bisect_right(self.milestones, step)
