"""torch's schedules under ColossalAI's signatures (`total_steps` second; OneCycleLR takes its
maximum rate from each group's `lr`), as `colossalai/nn/lr_scheduler/torch.py` and
`onecycle.py` have them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import lr_scheduler

from shardwise.nn.lr_scheduler.schedule import note_ignored

Factor = Callable[[int], float] | list[Callable[[int], float]]


class LambdaLR(lr_scheduler.LambdaLR):
    """torch's LambdaLR; `total_steps` is taken and not used, as in ColossalAI.

    Args:
        optimizer, lr_lambda, last_epoch: torch's.
        total_steps: not used.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        lr_lambda: Factor | None = None,
        last_epoch: int = -1,
    ) -> None:
        if lr_lambda is None:
            raise ValueError("LambdaLR needs lr_lambda")
        super().__init__(optimizer, lr_lambda, last_epoch=last_epoch)


class MultiplicativeLR(lr_scheduler.MultiplicativeLR):
    """torch's MultiplicativeLR; `total_steps` is taken and not used, as in ColossalAI.

    Args:
        optimizer, lr_lambda, last_epoch: torch's.
        total_steps: not used.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        lr_lambda: Factor | None = None,
        last_epoch: int = -1,
    ) -> None:
        if lr_lambda is None:
            raise ValueError("MultiplicativeLR needs lr_lambda")
        super().__init__(optimizer, lr_lambda, last_epoch=last_epoch)


class StepLR(lr_scheduler.StepLR):
    """torch's StepLR; `total_steps` is taken and not used, as in ColossalAI.

    Args:
        optimizer, step_size, gamma, last_epoch: torch's.
        total_steps: not used.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        step_size: int = 1,
        gamma: float = 0.1,
        last_epoch: int = -1,
    ) -> None:
        super().__init__(optimizer, step_size, gamma=gamma, last_epoch=last_epoch)


class ExponentialLR(lr_scheduler.ExponentialLR):
    """torch's ExponentialLR; `total_steps` is taken and not used, as in ColossalAI.

    Args:
        optimizer, gamma, last_epoch: torch's.
        total_steps: not used.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        gamma: float = 1.0,
        last_epoch: int = -1,
    ) -> None:
        super().__init__(optimizer, gamma, last_epoch=last_epoch)


class OneCycleLR(lr_scheduler.OneCycleLR):
    """torch's OneCycleLR over `total_steps`, each group's current `lr` its maximum rate.

    Args:
        optimizer: the optimizer.
        total_steps: steps of the cycle.
        pct_start, anneal_strategy, cycle_momentum, base_momentum, max_momentum, div_factor,
            final_div_factor, last_epoch: torch's.
        **kwargs: ignored, as ColossalAI ignores them (logged).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float = 0.85,
        max_momentum: float = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 10000.0,
        last_epoch: int = -1,
        **kwargs: Any,
    ) -> None:
        note_ignored(type(self).__name__, kwargs)
        max_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(
            optimizer,
            max_lrs,
            total_steps=total_steps,
            pct_start=pct_start,
            anneal_strategy=anneal_strategy,  # type: ignore[arg-type]
            cycle_momentum=cycle_momentum,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            last_epoch=last_epoch,
        )
