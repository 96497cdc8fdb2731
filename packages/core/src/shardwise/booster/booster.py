"""Booster: ColossalAI's training front end (`colossalai.booster.Booster`) over the engine; the
plugin decides how the model and optimizer are wrapped."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from shardwise import telemetry
from shardwise.booster.mixed_precision import (
    MixedPrecision,
    TorchAMPModule,
    mixed_precision_factory,
)
from shardwise.booster.plugin.plugin_base import Boosted, Plugin
from shardwise.interface import OptimizerWrapper


class Booster:
    """Wraps a model, optimizer, criterion, data loader and LR scheduler for distributed
    training as its `plugin` says (`GeminiPlugin`, `LowLevelZeroPlugin`, `TorchDDPPlugin`).

    Args:
        device: ignored, with a warning, as ColossalAI ignores it with a plugin: the plugin
            places the model (on cuda:<current> when there is one, else the CPU).
        mixed_precision: "fp16" (torch autocast and a gradient scaler), "bf16" (torch
            autocast) or a `MixedPrecision` object, applied after a plugin that leaves the
            precision to the Booster (TorchDDPPlugin); GeminiPlugin and LowLevelZeroPlugin
            take `precision=` themselves, and there it is ignored with a warning, as in
            ColossalAI.
        plugin: the plugin; required (a plain single-process run needs no Booster).
    """

    def __init__(
        self,
        device: str | None = None,
        mixed_precision: str | MixedPrecision | None = None,
        plugin: Plugin | None = None,
    ) -> None:
        if plugin is None:
            raise ValueError(
                "Booster needs a plugin: GeminiPlugin (ZeRO-3), LowLevelZeroPlugin (ZeRO-1/2) or "
                "TorchDDPPlugin, from shardwise.booster.plugin"
            )
        if not isinstance(plugin, Plugin):
            raise TypeError(f"plugin must be a shardwise Plugin, got {type(plugin).__name__}")
        name = type(plugin).__name__
        if device is not None:
            warnings.warn(
                f"Booster(device={device!r}) is ignored: {name} places the model (on "
                f"cuda:<current> when there is one, else the CPU), as in ColossalAI",
                UserWarning,
                stacklevel=2,
            )
        self.mixed_precision: MixedPrecision | None = None
        if mixed_precision is not None and plugin.control_precision():
            warnings.warn(
                f"Booster(mixed_precision={mixed_precision!r}) is ignored: {name} controls the "
                f"precision (its precision= argument), as in ColossalAI",
                UserWarning,
                stacklevel=2,
            )
        elif isinstance(mixed_precision, str):
            self.mixed_precision = mixed_precision_factory(mixed_precision)
        elif isinstance(mixed_precision, MixedPrecision):
            self.mixed_precision = mixed_precision
        elif mixed_precision is not None:
            raise TypeError(
                f"mixed_precision must be 'fp16', 'bf16' or a MixedPrecision, got "
                f"{type(mixed_precision).__name__}"
            )
        self.plugin = plugin
        self.checkpoint_io = plugin.get_checkpoint_io()

    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: Any = None,
    ) -> Boosted:
        """`(model, optimizer, criterion, dataloader, lr_scheduler)` boosted by the plugin:
        the model and optimizer wrapped; the criterion, data loader and LR scheduler as given
        (a scheduler over the optimizer keeps driving its learning rate)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        # A run whose telemetry starts here says the Booster and its plugin started it.
        with telemetry.front_door(f"Booster {type(self.plugin).__name__}"):
            model, boosted, criterion, dataloader, lr_scheduler = self.plugin.configure(
                model, optimizer, criterion, dataloader, lr_scheduler
            )
        if self.mixed_precision is not None and not isinstance(model, TorchAMPModule):
            model, boosted, criterion = self.mixed_precision.configure(model, boosted, criterion)
        return model, boosted, criterion, dataloader, lr_scheduler

    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        """Backward of `loss` through the boosted optimizer (which scales it under fp16)."""
        if not isinstance(optimizer, OptimizerWrapper):
            raise TypeError(
                f"optimizer must be the one boost() returned, got {type(optimizer).__name__}"
            )
        optimizer.backward(loss)

    @contextmanager
    def no_sync(
        self, model: nn.Module | None = None, optimizer: OptimizerWrapper | None = None
    ) -> Iterator[None]:
        """Accumulate gradients without reducing them during the backward passes inside; the
        next backward outside reduces the sum (every plugin, every stage)."""
        if isinstance(model, TorchAMPModule):
            model = model.module  # the plugin's model, inside the precision's wrapper
        with self.plugin.no_sync(model, optimizer):
            yield

    def enable_lora(
        self,
        model: nn.Module,
        pretrained_dir: str | None = None,
        lora_config: Any = None,
        bnb_quantization_config: Any = None,
        quantize: bool = False,
    ) -> nn.Module:
        """`model` with peft's LoRA adapters added (from `lora_config`, or loaded from
        `pretrained_dir`), before `boost`: only the adapters train. Every plugin, Gemini
        included. Quantisation (`quantize`, `bnb_quantization_config`) is refused."""
        return self.plugin.enable_lora(
            model,
            pretrained_dir=pretrained_dir,
            lora_config=lora_config,
            bnb_quantization_config=bnb_quantization_config,
            quantize=quantize,
        )

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str, use_safetensors: bool = False
    ) -> None:
        """Write the LoRA adapters and their configuration to the directory `checkpoint` as
        peft's `save_pretrained` does, so `PeftModel.from_pretrained` reads them."""
        self.plugin.save_lora_as_pretrained(model, checkpoint, use_safetensors)

    def save_model(
        self,
        model: nn.Module,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Save the boosted model's weights, as its unwrapped module's `state_dict()` names them.

        With `shard`, `checkpoint` is a directory in Hugging Face's sharded layout (files of at
        most `size_per_shard` MB and an index; `config.json` for a `PreTrainedModel`), each
        rank writing the files it was given, so no rank holds the whole model; else one file
        that rank 0 writes. `prefix` goes into the file names (`pytorch_model.<prefix>.bin`).
        `gather_dtensor` and `use_async` are accepted: there are no distributed tensors to keep
        apart, and the files are complete when the call returns."""
        self.checkpoint_io.save_model(
            model,
            checkpoint,
            shard,
            gather_dtensor,
            prefix,
            size_per_shard,
            use_safetensors,
            use_async,
        )

    def load_model(
        self,
        model: nn.Module,
        checkpoint: str,
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load weights saved by `save_model` (any plugin, stage or world size), by
        `save_pretrained`, or by ColossalAI, into the boosted model: a file, or a directory
        with an index or one weights file. Each rank reads only the rows it keeps, whatever
        `low_cpu_mem_mode` says. With `strict`, missing or unexpected keys are an error."""
        self.checkpoint_io.load_model(model, checkpoint, strict, low_cpu_mem_mode, num_threads)

    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        """Save the boosted optimizer's state in ColossalAI's layout (torch's optimizer state
        dict, with whole-shape tensors, independent of world size and plugin): one file, or
        with `shard` a directory of `pytorch_optim-NNNNN.bin` files, each rank writing its
        own, the parameter groups in `pytorch_optim_group.bin` and an index."""
        self.checkpoint_io.save_optimizer(
            optimizer, checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_async
        )

    def load_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load optimizer state saved by `save_optimizer` (any plugin, stage or world size)."""
        self.checkpoint_io.load_optimizer(
            optimizer, checkpoint, low_cpu_mem_mode=low_cpu_mem_mode, num_threads=num_threads
        )

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        """Write `lr_scheduler.state_dict()` to the file `checkpoint` (rank 0 writes it, whole
        or not at all; every rank returns once it is there, or raises what rank 0 met)."""
        self.checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        """Load the state `save_lr_scheduler` wrote into `lr_scheduler` (every rank reads)."""
        self.checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint)
