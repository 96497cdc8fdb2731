"""Cosine schedules: annealing, with a linear warmup, and flat before annealing (ColossalAI's
`colossalai/nn/lr_scheduler/cosine.py` signatures and values)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR as _TorchCosineAnnealingLR

from shardwise.nn.lr_scheduler.schedule import ClosedFormLR, note_ignored, warmup_factor


def _cosine(step: int, steps: int, base_lr: float, eta_min: float) -> float:
    return eta_min + (base_lr - eta_min) * (1 + math.cos(math.pi * step / steps)) / 2


class CosineAnnealingLR(_TorchCosineAnnealingLR):
    """torch's cosine annealing over `total_steps` (its `T_max`) down to `eta_min`.

    Args:
        optimizer: the optimizer.
        total_steps: steps of the half cosine.
        eta_min: the lowest learning rate.
        last_epoch: the step to resume after (-1: start).
        **kwargs: ignored, as ColossalAI ignores them (logged).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        eta_min: float = 0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        note_ignored(type(self).__name__, kwargs)
        super().__init__(optimizer, total_steps, eta_min=eta_min, last_epoch=last_epoch)


class CosineAnnealingWarmupLR(ClosedFormLR):
    """A linear warmup over `warmup_steps` (see [Note: ColossalAI's warmup]), then cosine
    annealing from the base rate to `eta_min` over the remaining `total_steps - warmup_steps`.

    Args:
        optimizer: the optimizer.
        total_steps: steps of the whole schedule.
        warmup_steps: steps of the warmup.
        eta_min: the lowest learning rate.
        last_epoch: the step to resume after (-1: start).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if not 0 <= warmup_steps < total_steps:
            raise ValueError(
                f"warmup_steps must be in [0, total_steps={total_steps}), got {warmup_steps}"
            )
        self.total_steps, self.warmup_steps, self.eta_min = total_steps, warmup_steps, eta_min
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        if step < self.warmup_steps:
            return warmup_factor(step, self.warmup_steps) * base_lr
        steps = self.total_steps - self.warmup_steps
        return _cosine(step - self.warmup_steps, steps, base_lr, self.eta_min)


class FlatAnnealingLR(ClosedFormLR):
    """The base rate for the first `pct_start` of `total_steps`, then cosine annealing to 0
    over the rest.

    Args:
        optimizer: the optimizer.
        total_steps: steps of the whole schedule.
        pct_start: the flat share, in [0, 1].
        last_epoch: the step to resume after (-1: start).
        **kwargs: ignored, as ColossalAI ignores them (logged).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        pct_start: float = 0.72,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        if not 0.0 <= pct_start <= 1.0:
            raise ValueError(f"pct_start must be in [0, 1], got {pct_start}")
        note_ignored(type(self).__name__, kwargs)
        self.flat_steps = int(total_steps * pct_start)
        self.anneal_steps = total_steps - self.flat_steps
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        if step < self.flat_steps:
            return base_lr
        return _cosine(step - self.flat_steps, self.anneal_steps, base_lr, 0.0)


class FlatAnnealingWarmupLR(ClosedFormLR):
    """A linear warmup over `warmup_steps`, the base rate for `pct_start` of the steps after
    it, then cosine annealing to `eta_min` over the rest.

    Args:
        optimizer: the optimizer.
        total_steps: steps of the whole schedule.
        warmup_steps: steps of the warmup.
        pct_start: the flat share of the steps after the warmup, in [0, 1].
        eta_min: the lowest learning rate.
        last_epoch: the step to resume after (-1: start).
        **kwargs: ignored, as ColossalAI ignores them (logged).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        pct_start: float = 0.72,
        eta_min: float = 0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        if not 0.0 <= pct_start <= 1.0:
            raise ValueError(f"pct_start must be in [0, 1], got {pct_start}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        note_ignored(type(self).__name__, kwargs)
        self.warmup_steps = warmup_steps
        self.flat_steps = int((total_steps - warmup_steps) * pct_start)
        self.anneal_steps = total_steps - warmup_steps - self.flat_steps
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base_lr: float) -> float:
        if step < self.warmup_steps:
            return warmup_factor(step, self.warmup_steps) * base_lr
        if step < self.warmup_steps + self.flat_steps:
            return base_lr
        annealed = step - self.warmup_steps - self.flat_steps
        return _cosine(annealed, self.anneal_steps, base_lr, self.eta_min)
