"""Booster: ColossalAI's training front end (`colossalai.booster.Booster`) over the engine; the
plugin decides how the model and optimizer are wrapped."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from shardwise.booster.plugin.plugin_base import Boosted, Plugin
from shardwise.interface import OptimizerWrapper


class Booster:
    """Wraps a model, optimizer, criterion, data loader and LR scheduler for distributed
    training as its `plugin` says (`GeminiPlugin`, `LowLevelZeroPlugin`, `TorchDDPPlugin`).

    Args:
        device: refused unless None: the plugin places the model (ColossalAI ignores it with
            a plugin too).
        mixed_precision: refused unless None: the ZeRO plugins take `precision=`; for
            TorchDDPPlugin, mixed precision is not offered yet.
        plugin: the plugin; required (a plain single-process run needs no Booster).
    """

    def __init__(
        self,
        device: str | None = None,
        mixed_precision: Any = None,
        plugin: Plugin | None = None,
    ) -> None:
        if plugin is None:
            raise ValueError(
                "Booster needs a plugin: GeminiPlugin (ZeRO-3), LowLevelZeroPlugin (ZeRO-1/2) or "
                "TorchDDPPlugin, from shardwise.booster.plugin"
            )
        if not isinstance(plugin, Plugin):
            raise TypeError(f"plugin must be a shardwise Plugin, got {type(plugin).__name__}")
        if device is not None:
            raise ValueError(
                f"device={device!r} cannot be honoured: the plugin places the model (on "
                f"cuda:<current> when there is one, else the CPU); leave device None"
            )
        if mixed_precision is not None:
            raise ValueError(
                f"mixed_precision={mixed_precision!r} cannot be honoured: GeminiPlugin and "
                f"LowLevelZeroPlugin take precision='fp16' / 'bf16' / 'fp32'; TorchDDPPlugin "
                f"trains in the model's own dtype"
            )
        self.plugin = plugin

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
        return self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler)

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
        with self.plugin.no_sync(model, optimizer):
            yield

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        """Write `lr_scheduler.state_dict()` to the file `checkpoint` (rank 0 writes it, whole
        or not at all; every rank returns once it is there, or raises what rank 0 met)."""
        path = Path(checkpoint)
        problem: str | None = None
        if dist.get_rank() == 0:
            try:
                if path.is_dir():
                    raise ValueError(f"{checkpoint} is a directory: give the file to write")
                partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
                torch.save(lr_scheduler.state_dict(), partial)
                os.replace(partial, path)
            except (OSError, ValueError) as error:
                problem = f"{type(error).__name__}: {error}"
        # Rank 0's outcome reaches every rank, so none waits for a file that never comes.
        outcome = [problem]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise RuntimeError(f"save_lr_scheduler failed on rank 0: {outcome[0]}")

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        """Load the state `save_lr_scheduler` wrote into `lr_scheduler` (every rank reads)."""
        lr_scheduler.load_state_dict(torch.load(checkpoint, weights_only=True))
