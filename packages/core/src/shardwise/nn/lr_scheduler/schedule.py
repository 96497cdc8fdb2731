"""ClosedFormLR: a learning-rate schedule whose value at each step is a function of the step
and the group's base learning rate, written out (ColossalAI composes its warmup schedules from
two chained torch schedulers; the values are the same, within float rounding, and resuming
needs only the step count).

[Note: ColossalAI's warmup]
ColossalAI's warmup schedules (`WarmupScheduler`) rise linearly as (step + 1) / warmup_steps
of the base rate over the first `warmup_steps` steps and hand over at step `warmup_steps` to
the schedule that follows, started at its own step 0; its `LinearWarmupLR` rises as
(step + 1) / (warmup_steps + 1) instead. Both are kept as they are.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

_log = logging.getLogger(__name__)


class ClosedFormLR(LRScheduler):
    """A schedule given by `factor(step, base_lr)`: the learning rate of a group at `step`.

    Args:
        optimizer: the optimizer whose groups' `lr` is set.
        last_epoch: the step to resume after (-1: start).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, last_epoch: int = -1) -> None:
        super().__init__(optimizer, last_epoch)

    @abstractmethod
    def lr_at(self, step: int, base_lr: float) -> float:
        """The learning rate at `step` of a group whose base rate is `base_lr`."""

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [self.lr_at(self.last_epoch, float(base)) for base in self.base_lrs]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()


def warmup_factor(step: int, warmup_steps: int) -> float:
    """ColossalAI's warmup share of the base rate at `step` < `warmup_steps` (see [Note:
    ColossalAI's warmup])."""
    return (step + 1) / warmup_steps


def note_ignored(schedule: str, extra: Mapping[str, Any]) -> None:
    """ColossalAI's schedules take and ignore other keywords: accepted, and logged."""
    if extra:
        _log.warning("%s ignores %s, as ColossalAI's does", schedule, sorted(extra))
