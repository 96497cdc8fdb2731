"""bf16 with torch autocast: the model and criterion run under bf16 autocast; bf16 keeps fp32's
exponent range, so gradients need no scaler and the optimizer is left as it is. (ColossalAI
maps "bf16" to an abstract class, which cannot be built: a script asking for it fails there.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.booster.mixed_precision.autocast_module import TorchAMPModule
from shardwise.booster.mixed_precision.mixed_precision_base import MixedPrecision
from shardwise.interface import OptimizerWrapper


class BF16MixedPrecision(MixedPrecision):
    """bf16 autocast for the model and criterion."""

    def configure(
        self,
        model: nn.Module,
        optimizer: OptimizerWrapper | None = None,
        criterion: Callable[..., Any] | None = None,
    ) -> tuple[nn.Module, OptimizerWrapper | None, Callable[..., Any] | None]:
        amp_criterion = TorchAMPModule(criterion, torch.bfloat16) if criterion is not None else None
        return TorchAMPModule(model, torch.bfloat16), optimizer, amp_criterion
