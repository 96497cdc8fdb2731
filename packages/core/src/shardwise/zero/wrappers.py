"""The seed API: zero_model_wrapper and zero_optim_wrapper over one chunk engine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardwise.amp import LossScaleConfig
from shardwise.zero.config import (
    DEFAULT_REDUCE_BUCKET_NUMEL,
    MixedPrecision,
    ZeroConfig,
    compute_device,
)
from shardwise.zero.gemini_ddp import GeminiDDP, gemini_ddp_from_config
from shardwise.zero.model import ZeroModel
from shardwise.zero.optimizer import ZeroOptimizer, check_no_optimizer_yet, grad_scaler_for

_OPTIM_CONFIG_KEYS = ("reduce_bucket_size", "overlap_communication", "overlap_param_gather")


def zero_model_wrapper(
    model: nn.Module, zero_stage: int = 1, gemini_config: Mapping[str, Any] | None = None
) -> ZeroModel:
    """Wrap `model` for ZeRO data parallelism at `zero_stage` (1, 2 or 3).

    Stage 3 builds a `GeminiDDP` from `gemini_config` (see `GeminiDDP` for its keys: device,
    placement_policy, chunk_size, mixed_precision, shard_size, ...). Stages 1 and 2 take
    `device`, `mixed_precision`, `process_group` and `shard_size` from it; their bucket size
    comes from `zero_optim_wrapper`'s `optim_config["reduce_bucket_size"]`.

    Args:
        model: the module to wrap.
        zero_stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
        gemini_config: keyword options, as a dict.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = dict(gemini_config or {})
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int):
        raise TypeError(f"zero_stage must be an int (1, 2 or 3), got {zero_stage!r}")
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
    if zero_stage == 3:
        return gemini_ddp_from_config(model, config)
    allowed = (
        "device",
        "mixed_precision",
        "process_group",
        "force_outputs_fp32",
        "gradient_reduction",
        "param_init_fn",
        "shard_size",
    )
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise ValueError(
            f"gemini_config keys {unknown} have no meaning at stage {zero_stage}; "
            f"stages 1 and 2 take {list(allowed)}"
        )
    return _LowLevelZeroModel(
        model,
        ZeroConfig(
            stage=zero_stage,
            chunk_size_numel=DEFAULT_REDUCE_BUCKET_NUMEL,
            device=compute_device(config.get("device")),
            mixed_precision=config.get("mixed_precision", MixedPrecision()),
            process_group=config.get("process_group"),
            force_outputs_fp32=config.get("force_outputs_fp32", False),
            gradient_reduction=config.get("gradient_reduction", "auto"),
            param_init_fn=config.get("param_init_fn"),
            shard_size=config.get("shard_size"),
        ),
    )


class _LowLevelZeroModel(ZeroModel):
    """Stages 1 and 2, whose gradient bucket size is only known once the optimizer is wrapped:
    `zero_optim_wrapper` re-packs the chunks when its `reduce_bucket_size` differs from the
    size they were packed with (see `ZeroModel.configure_reduction`)."""


def zero_optim_wrapper(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    initial_scale: float = 2**16,
    growth_factor: float = 2,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
    min_scale: float = 1,
    max_scale: float = 2**32,
    max_norm: float = 0.0,
    norm_type: float = 2.0,
    optim_config: Mapping[str, Any] | None = None,
    *,
    warn_after_skipped_steps: int = 10,
    loss_scale: LossScaleConfig | None = None,
) -> ZeroOptimizer:
    """Wrap `optimizer` (built over `model.parameters()`) to step sharded fp32 master weights.

    Call `optimizer.backward(loss)` instead of `loss.backward()`, then `step()` and
    `zero_grad()`. A dynamic loss scale is used when any dtype of the model is fp16; fp32 and
    bf16 train with a constant scale of 1 (the scaler arguments are still validated).

    Args:
        model: the model returned by `zero_model_wrapper`.
        optimizer: an elementwise torch optimizer over its parameters, not yet stepped.
        initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
            max_scale: the `DynamicGradScaler` settings.
        max_norm: clip the global gradient norm to this; 0 disables clipping.
        norm_type: the clipping norm (2.0, math.inf, ...).
        optim_config: stage 1/2 options: `reduce_bucket_size` (elements per gradient bucket,
            default 12M)
            and `overlap_communication` (bool, default True: stage 2 reduces each bucket
            while backward goes on, as DDP does; stage 1 reduces at the step either way) and
            `overlap_param_gather` (bool, default True: let the all-gather of updated
            parameters run into the next forward, any read of a parameter before it waiting
            for its chunk; False waits for it in `step()`; see `ZeroConfig`).
        warn_after_skipped_steps: warn when this many steps in a row were skipped for inf or
            nan gradients with no loss scale left to lower (see `ZeroOptimizer`).
        loss_scale: the seven scaler settings as one `LossScaleConfig`, in place of the
            separate arguments (which must then keep their defaults).
    """
    if not isinstance(model, ZeroModel):
        raise TypeError(
            f"model must be the result of zero_model_wrapper, got {type(model).__name__}"
        )
    check_no_optimizer_yet(model)
    separate = LossScaleConfig(
        initial_scale=initial_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
    )
    if loss_scale is None:
        loss_scale = separate
    elif not isinstance(loss_scale, LossScaleConfig):
        raise TypeError(f"loss_scale must be a LossScaleConfig, got {loss_scale!r}")
    elif separate != LossScaleConfig():
        raise ValueError(
            "pass the loss-scale settings either as loss_scale=LossScaleConfig(...) or as "
            "separate arguments, not both"
        )
    options = dict(optim_config or {})
    unknown = sorted(set(options) - set(_OPTIM_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"optim_config keys {unknown} are unknown; known keys: {list(_OPTIM_CONFIG_KEYS)}"
        )
    if model.stage == 3 and options:
        raise ValueError(
            f"optim_config {sorted(options)} applies to stages 1 and 2; at stage 3 the chunk "
            f"size (gemini_config['chunk_size_numel']) sets the reduction granularity"
        )
    if isinstance(model, _LowLevelZeroModel):
        bucket = options.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET_NUMEL)
        # Overlapping was faster in every interleaved stage-2 measurement here, and costs only
        # the in-flight buckets' receive buffers until backward ends.
        overlap = options.get("overlap_communication", True)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap_communication must be a bool, got {overlap!r}")
        # Deferred: the all-gather of updated parameters is the one collective of stages 1-2
        # nothing else overlaps (2-5% of DDP's step time here when waited in the step), and a
        # read of a parameter before the next forward waits for it (PendingParameter).
        param_gather = options.get("overlap_param_gather", True)
        if not isinstance(param_gather, bool):
            raise TypeError(f"overlap_param_gather must be a bool, got {param_gather!r}")
        model.configure_reduction(
            chunk_size_numel=bucket,
            overlap_communication=overlap,
            overlap_param_gather=param_gather,
        )
    return ZeroOptimizer(
        model,
        optimizer,
        grad_scaler=grad_scaler_for(model, loss_scale),
        max_norm=max_norm,
        norm_type=norm_type,
        warn_after_skipped_steps=warn_after_skipped_steps,
    )


__all__ = ["GeminiDDP", "zero_model_wrapper", "zero_optim_wrapper"]
