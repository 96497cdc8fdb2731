"""fp16 with torch autocast and a gradient scaler (ColossalAI's `FP16TorchMixedPrecision`):
the model and criterion run under autocast, and the optimizer scales the loss in `backward`,
unscales before clipping, and steps and updates the scale through `torch.amp.GradScaler`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.accelerator import get_accelerator
from shardwise.booster.mixed_precision.autocast_module import TorchAMPModule
from shardwise.booster.mixed_precision.mixed_precision_base import MixedPrecision
from shardwise.interface import OptimizerWrapper


class TorchAMPOptimizer(OptimizerWrapper):
    """`optim` behind a `torch.amp.GradScaler` on the accelerator's device type.

    Args:
        optim: the torch optimizer.
        init_scale, growth_factor, backoff_factor, growth_interval: the GradScaler's.
    """

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        super().__init__(optim)
        self.scaler = torch.amp.GradScaler(
            get_accelerator().get_current_device().type,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )

    def backward(
        self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False, **kwargs: Any
    ) -> None:
        self.scaler.scale(loss).backward(inputs=inputs, retain_graph=retain_graph, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Step unless a gradient is inf or nan (the scaler then lowers the scale)."""
        out = self.scaler.step(self.optim, *args, **kwargs)
        self.scaler.update()
        return out

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_grad(self) -> None:
        self.scaler.unscale_(self.optim)

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        self.unscale_grad()
        super().clip_grad_by_value(clip_value, *args, **kwargs)

    def clip_grad_by_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Unscale the gradients, then clip them now; returns their norm."""
        self.unscale_grad()
        return super().clip_grad_by_norm(max_norm, norm_type, error_if_nonfinite, *args, **kwargs)


class FP16TorchMixedPrecision(MixedPrecision):
    """fp16 autocast for the model and criterion, a GradScaler for the optimizer.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval: the GradScaler's
            (ColossalAI's defaults).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.init_scale, self.growth_factor = init_scale, growth_factor
        self.backoff_factor, self.growth_interval = backoff_factor, growth_interval

    def configure(
        self,
        model: nn.Module,
        optimizer: OptimizerWrapper | None = None,
        criterion: Callable[..., Any] | None = None,
    ) -> tuple[nn.Module, OptimizerWrapper | None, Callable[..., Any] | None]:
        amp_optimizer = None
        if optimizer is not None:
            amp_optimizer = TorchAMPOptimizer(
                optimizer.unwrap(),
                init_scale=self.init_scale,
                growth_factor=self.growth_factor,
                backoff_factor=self.backoff_factor,
                growth_interval=self.growth_interval,
            )
        amp_criterion = TorchAMPModule(criterion) if criterion is not None else None
        return TorchAMPModule(model), amp_optimizer, amp_criterion
