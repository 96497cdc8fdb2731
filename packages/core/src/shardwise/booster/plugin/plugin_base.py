"""The plugin interface of the Booster (ColossalAI's `Plugin`): how a plugin wraps the model and
optimizer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from shardwise.checkpoint_io import CheckpointIO
from shardwise.interface import OptimizerWrapper

Boosted = tuple[nn.Module, OptimizerWrapper | None, Callable[..., Any] | None, Any, Any]


class Plugin(ABC):
    """What a plugin does for the Booster."""

    @abstractmethod
    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: Any = None,
    ) -> Boosted:
        """The boosted (model, optimizer, criterion, dataloader, lr_scheduler)."""

    @abstractmethod
    def support_no_sync(self) -> bool: ...

    @abstractmethod
    def no_sync(
        self, model: nn.Module | None, optimizer: OptimizerWrapper | None = None
    ) -> AbstractContextManager[None]:
        """A context in whose backward passes gradients accumulate unreduced."""

    def control_precision(self) -> bool:
        return True

    def support_lora(self) -> bool:
        return False

    def enable_lora(
        self,
        model: nn.Module,
        pretrained_dir: str | None = None,
        lora_config: Any = None,
        bnb_quantization_config: Any = None,
        quantize: bool = False,
    ) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA")

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str, use_safetensors: bool = False
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support LoRA")

    @abstractmethod
    def get_checkpoint_io(self) -> CheckpointIO:
        """The object the Booster's save_* / load_* methods go through."""

    def control_device(self) -> bool:
        return True
