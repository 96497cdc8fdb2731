"""The checkpoint IO of GeminiPlugin and LowLevelZeroPlugin: every rank writes the files it was
given from one gathered chunk at a time, and reads only what it owns (see
shardwise/checkpoint/zero_model_io.py and zero_optimizer_io.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.checkpoint.optimizer_checkpoint import OptimizerCheckpoint
from shardwise.checkpoint.zero_model_io import load_zero_model, save_zero_model
from shardwise.checkpoint.zero_optimizer_io import load_zero_optimizer, save_zero_optimizer
from shardwise.checkpoint_io import CheckpointIO
from shardwise.engine.model import ZeroModel
from shardwise.zero.optimizer_wrapper import ZeroOptimizerWrapper


class ZeroCheckpointIO(CheckpointIO):
    def _save_model(
        self,
        model: nn.Module,
        checkpoint: str,
        *,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
        use_safetensors: bool,
    ) -> None:
        save_zero_model(
            _boosted(model),
            checkpoint,
            shard=shard,
            prefix=prefix,
            size_per_shard=size_per_shard,
            use_safetensors=use_safetensors,
        )

    def _load_model(self, model: nn.Module, checkpoint: str, *, strict: bool) -> None:
        load_zero_model(_boosted(model), checkpoint, strict=strict)

    def _save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str,
        *,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
    ) -> None:
        save_zero_optimizer(
            _boosted_optimizer(optimizer).engine,
            checkpoint,
            shard=shard,
            prefix=prefix,
            size_per_shard=size_per_shard,
        )

    def _load_optimizer(self, optimizer: Any, checkpoint: str) -> None:
        load_zero_optimizer(
            _boosted_optimizer(optimizer).engine, OptimizerCheckpoint.open(checkpoint)
        )


def _boosted(model: nn.Module) -> ZeroModel:
    if not isinstance(model, ZeroModel):
        raise TypeError(
            f"model must be the one booster.boost() returned, got {type(model).__name__}"
        )
    return model


def _boosted_optimizer(optimizer: Any) -> ZeroOptimizerWrapper:
    if not isinstance(optimizer, ZeroOptimizerWrapper):
        raise TypeError(
            f"optimizer must be the one booster.boost() returned, got {type(optimizer).__name__}"
        )
    return optimizer
