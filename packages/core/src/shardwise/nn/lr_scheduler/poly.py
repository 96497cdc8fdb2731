"""Polynomial decay, with and without warmup (ColossalAI's
`colossalai/nn/lr_scheduler/poly.py`)."""

from __future__ import annotations

from typing import Any

import torch

from shardwise.nn.lr_scheduler.schedule import ClosedFormLR, note_ignored, warmup_factor


def _polynomial(step: int, steps: int, base_lr: float, end_lr: float, power: float) -> float:
    return float((base_lr - end_lr) * (1 - min(step, steps) / steps) ** power + end_lr)


class PolynomialLR(ClosedFormLR):
    """The rate falls from the base rate to `end_lr` as (1 - step / total_steps) ** power.

    Args:
        optimizer: the optimizer.
        total_steps: steps of the decay.
        end_lr: the final learning rate (>= 0).
        power: the polynomial's power.
        last_epoch: the step to resume after (-1: start).
        **kwargs: ignored, as ColossalAI ignores them (logged).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        if end_lr < 0:
            raise ValueError(f"end_lr must be >= 0, got {end_lr}")
        note_ignored(type(self).__name__, kwargs)
        self.total_steps, self.end_lr, self.power = total_steps, end_lr, power
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        return _polynomial(step, self.total_steps, base_lr, self.end_lr, self.power)


class PolynomialWarmupLR(ClosedFormLR):
    """A linear warmup over `warmup_steps`, then `PolynomialLR` over the remaining steps.

    Args:
        optimizer: the optimizer.
        total_steps: steps of the whole schedule.
        warmup_steps: steps of the warmup.
        end_lr: the final learning rate (>= 0).
        power: the polynomial's power.
        last_epoch: the step to resume after (-1: start).
        **kwargs: ignored, as ColossalAI ignores them (logged).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        end_lr: float = 0.0001,
        power: float = 1.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        if end_lr < 0:
            raise ValueError(f"end_lr must be >= 0, got {end_lr}")
        note_ignored(type(self).__name__, kwargs)
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        self.end_lr, self.power = end_lr, power
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        if step < self.warmup_steps:
            return warmup_factor(step, self.warmup_steps) * base_lr
        steps = self.total_steps - self.warmup_steps
        return _polynomial(step - self.warmup_steps, steps, base_lr, self.end_lr, self.power)
