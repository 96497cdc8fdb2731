"""TorchAMPModule: a boosted model (or criterion) whose calls run under torch autocast on the
device it computes on (ColossalAI's `TorchAMPModule`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.accelerator import get_accelerator
from shardwise.interface import ModelWrapper


class TorchAMPModule(ModelWrapper):
    """Calls `module` under `torch.autocast(<the accelerator's device type>, dtype)`.

    Args:
        module: the boosted model, or the criterion (any callable).
        dtype: the autocast dtype (fp16 or bf16).
    """

    def __init__(
        self, module: nn.Module | Callable[..., Any], dtype: torch.dtype = torch.float16
    ) -> None:
        super().__init__(module)  # type: ignore[arg-type]  # a plain callable criterion too
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with get_accelerator().autocast(dtype=self.dtype):
            return self.module(*args, **kwargs)
