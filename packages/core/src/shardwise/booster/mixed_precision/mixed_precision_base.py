"""MixedPrecision: how `Booster(mixed_precision=...)` wraps a boosted model, optimizer and
criterion (ColossalAI's `colossalai.booster.mixed_precision.MixedPrecision`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from torch import nn

from shardwise.interface import OptimizerWrapper


class MixedPrecision(ABC):
    """A precision the Booster applies after the plugin, when the plugin leaves it the
    precision (`Plugin.control_precision()` is False)."""

    @abstractmethod
    def configure(
        self,
        model: nn.Module,
        optimizer: OptimizerWrapper | None = None,
        criterion: Callable[..., Any] | None = None,
    ) -> tuple[nn.Module, OptimizerWrapper | None, Callable[..., Any] | None]:
        """The model, optimizer and criterion, wrapped to run in this precision."""
