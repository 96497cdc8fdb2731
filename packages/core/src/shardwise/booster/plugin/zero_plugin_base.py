"""What GeminiPlugin and LowLevelZeroPlugin share: the engine wraps the model and optimizer as
the plugin's `EngineConfig` says, and `no_sync` is the model's."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from shardwise.amp import LossScaleConfig
from shardwise.booster.plugin.plugin_base import Boosted, DPPluginBase
from shardwise.booster.zero_optimizer import ZeroOptimizerWrapper
from shardwise.engine.config import EngineConfig
from shardwise.engine.model import ZeroModel
from shardwise.engine.wrap import wrap_model, wrap_optimizer
from shardwise.interface import OptimizerWrapper


class ZeroPluginBase(DPPluginBase):
    """A plugin over the ZeRO engine: a subclass gives `engine_config()` and sets the step's
    `loss_scale`, `max_norm` and `norm_type`."""

    loss_scale: LossScaleConfig
    max_norm: float
    norm_type: float

    @abstractmethod
    def engine_config(self) -> EngineConfig:
        """The plugin's arguments as the engine's configuration."""

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: Any = None,
    ) -> Boosted:
        if not isinstance(model, ZeroModel):
            model = wrap_model(model, self.engine_config())
        boosted: OptimizerWrapper | None = None
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            boosted = ZeroOptimizerWrapper(
                wrap_optimizer(
                    model,
                    optimizer,
                    loss_scale=self.loss_scale,
                    max_norm=self.max_norm,
                    norm_type=self.norm_type,
                )
            )
        elif optimizer is not None:
            boosted = optimizer
        return model, boosted, criterion, dataloader, lr_scheduler

    def support_no_sync(self) -> bool:
        return True

    @contextmanager
    def no_sync(  # type: ignore[override]  # a generator-based context manager
        self, model: nn.Module | None, optimizer: OptimizerWrapper | None = None
    ) -> Iterator[None]:
        """Accumulate gradients locally, unreduced, during the backward passes inside."""
        if not isinstance(model, ZeroModel):
            raise TypeError(f"no_sync needs the boosted model, got {type(model).__name__}")
        with model.no_sync():
            yield
