"""The one way in: a module and an `EngineConfig` to the engine's model, and that model and a
torch optimizer to the engine's optimizer. Every front door ends here (see [Note: one
configuration] in zero/front_door.py): the seed wrappers, `GeminiDDP`, the Lightning strategies
and the Trainer callback."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.amp import LossScaleConfig
from shardwise.chunk import ChunkManager
from shardwise.comm import CommStats
from shardwise.engine.build import chunk_manager_for, gemini_manager_for, settle_chunk_size
from shardwise.engine.config import EngineConfig
from shardwise.engine.model import ZeroModel
from shardwise.engine.optimizer import ZeroOptimizer, check_no_optimizer_yet, grad_scaler_for
from shardwise.gemini import GeminiManager


def model_parts(
    module: nn.Module, config: EngineConfig
) -> tuple[EngineConfig, ChunkManager | None, GeminiManager | None]:
    """What `ZeroModel(module, ...)` is built from: at stage 3 the config with its chunk size
    settled (searched over `module`'s parameters when not given), the empty chunk manager and
    the memory manager; at stages 1-2 the config alone, the model packing its chunks when
    first needed (see [Note: packed once the bucket size is known] in engine/packing.py)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
    if config.stage != 3:
        return config, None, None
    config, reason = settle_chunk_size(module, config)
    chunk_manager = chunk_manager_for(config, CommStats(), reason)
    return config, chunk_manager, gemini_manager_for(config, chunk_manager)


def wrap_model(module: nn.Module, config: EngineConfig) -> ZeroModel:
    """`module` sharded as `config` says."""
    return ZeroModel(module, *model_parts(module, config))


def wrap_optimizer(
    model: ZeroModel,
    optimizer: torch.optim.Optimizer,
    *,
    loss_scale: LossScaleConfig | None = None,
    max_norm: float = 0.0,
    norm_type: float = 2.0,
    warn_after_skipped_steps: int = 10,
    step_in_backward: bool | None = None,
) -> ZeroOptimizer:
    """`optimizer` (built over `model`'s parameters, not yet stepped) stepping `model`'s
    sharded fp32 master weights; see `ZeroOptimizer` for the arguments. The loss scale is
    dynamic, with `loss_scale`'s settings, when any of the model's dtypes is fp16, and a
    constant 1 otherwise."""
    if not isinstance(model, ZeroModel):
        raise TypeError(f"model must be a wrapped model (ZeroModel), got {type(model).__name__}")
    if loss_scale is None:
        loss_scale = LossScaleConfig()
    elif not isinstance(loss_scale, LossScaleConfig):
        raise TypeError(f"loss_scale must be a LossScaleConfig, got {loss_scale!r}")
    check_no_optimizer_yet(model)
    return ZeroOptimizer(
        model,
        optimizer,
        grad_scaler=grad_scaler_for(model, loss_scale),
        max_norm=max_norm,
        norm_type=norm_type,
        warn_after_skipped_steps=warn_after_skipped_steps,
        step_in_backward=step_in_backward,
    )


__all__ = ["model_parts", "wrap_model", "wrap_optimizer"]
