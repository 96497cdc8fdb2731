"""What GeminiPlugin and LowLevelZeroPlugin share: the engine wraps the model and optimizer as
the plugin's `EngineConfig` says, and `no_sync` is the model's."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from shardwise import telemetry
from shardwise.amp import LossScaleConfig
from shardwise.booster import lora
from shardwise.booster.plugin.dp_plugin_base import DPPluginBase
from shardwise.booster.plugin.plugin_base import Boosted
from shardwise.booster.plugin.zero_checkpoint_io import ZeroCheckpointIO
from shardwise.engine.config import EngineConfig
from shardwise.engine.model import ZeroModel
from shardwise.engine.wrap import wrap_model, wrap_optimizer
from shardwise.interface import OptimizerWrapper
from shardwise.lazy import initialiser_for
from shardwise.zero.optimizer_wrapper import ZeroOptimizerWrapper


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
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            lora.add_adapters_to_optimizer(model, optimizer)  # see [Note: LoRA on the engine]
        if not isinstance(model, ZeroModel):
            config = self.engine_config()
            # A model built in LazyInitContext gets its values module by module as the engine
            # packs it: see [Note: lazily built models] in lazy/lazy_init.py.
            initialise = initialiser_for(model)
            if initialise is not None:
                config = replace(config, param_init_fn=initialise)
            model = wrap_model(model, config)
        boosted: OptimizerWrapper | None = None
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            boosted = self.boost_optimizer(model, optimizer)
        elif optimizer is not None:
            boosted = optimizer
        return model, boosted, criterion, dataloader, lr_scheduler

    def boost_optimizer(
        self, model: ZeroModel, optimizer: torch.optim.Optimizer
    ) -> ZeroOptimizerWrapper:
        """`optimizer` stepping `model`'s sharded masters with the plugin's loss scale and
        clipping."""
        engine = wrap_optimizer(
            model,
            optimizer,
            loss_scale=self.loss_scale,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
        )
        telemetry.enable(model, engine)  # streams when the environment says where
        return ZeroOptimizerWrapper(engine)

    def support_no_sync(self) -> bool:
        return True

    def get_checkpoint_io(self) -> ZeroCheckpointIO:
        return ZeroCheckpointIO()

    @contextmanager
    def no_sync(  # type: ignore[override]  # a generator-based context manager
        self, model: nn.Module | None, optimizer: OptimizerWrapper | None = None
    ) -> Iterator[None]:
        """Accumulate gradients locally, unreduced, during the backward passes inside."""
        if not isinstance(model, ZeroModel):
            raise TypeError(f"no_sync needs the boosted model, got {type(model).__name__}")
        with model.no_sync():
            yield

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str, use_safetensors: bool = False
    ) -> None:
        """Gather the adapters only (the chunks holding them) and write them on rank 0."""
        name = type(self).__name__
        if not isinstance(model, ZeroModel):
            raise TypeError(
                f"{name}: save_lora_as_pretrained needs the boosted model, got "
                f"{type(model).__name__}"
            )
        peft_model = lora.peft_model_of(model, name)
        values = lora.gather_adapters(model, lora.saved_tensors(peft_model))
        lora.save_adapters(
            peft_model,
            checkpoint,
            values,
            use_safetensors,
            model.comm_stats,
            model.config.topology.process_group,
        )
