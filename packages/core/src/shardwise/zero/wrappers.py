"""The seed API: zero_model_wrapper and zero_optim_wrapper over one chunk engine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardwise import telemetry
from shardwise.amp import LossScaleConfig, loss_scale_from
from shardwise.engine.model import ZeroModel
from shardwise.engine.optimizer import ZeroOptimizer, check_no_optimizer_yet
from shardwise.engine.wrap import wrap_model, wrap_optimizer
from shardwise.zero import front_door
from shardwise.zero.gemini_ddp import GeminiDDP


def zero_model_wrapper(
    model: nn.Module, zero_stage: int = 1, gemini_config: Mapping[str, Any] | None = None
) -> ZeroModel:
    """Wrap `model` for ZeRO data parallelism at `zero_stage` (1, 2 or 3).

    Stage 3 builds a `GeminiDDP` from `gemini_config` (its keys: device, placement_policy,
    chunk_size_numel, mixed_precision, shard_size, ...: `front_door.GEMINI_CONFIG_KEYS`, each
    a field of `EngineConfig`). Stages 1 and 2 take `device`, `placement_policy` ("cuda", or
    "cpu" for the optimizer side in host memory), `pin_memory`, `mixed_precision`,
    `process_group`, `force_outputs_fp32`, `gradient_reduction`, `param_init_fn`,
    `shard_size` and the disk tier's keys from it; their bucket size comes from
    `zero_optim_wrapper`'s `optim_config["reduce_bucket_size"]`, and they pack the parameters
    once it is known.

    Every stage takes the wire formats (see `Communication`): `gather_format` and
    `reduce_format` ("dtype", the default, "int8" or "fp8": one byte per value with an fp32
    scale per `quant_block_numel` values, the gathers' decoded by the other ranks, the
    reductions' summed in fp32 by their owner), and ColossalAI's `fp8_communication=True`
    (both in fp8).

    Args:
        model: the module to wrap.
        zero_stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
        gemini_config: keyword options, as a dict.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = front_door.engine_config(zero_stage, gemini_config)
    if config.stage == 3:
        return GeminiDDP.from_config(model, config)
    return wrap_model(model, config)


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
    step_in_backward: bool | None = None,
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
            `overlap_param_gather` (bool, default True on a GPU and False on a CPU: let the
            all-gather of updated parameters run into the next forward, any read of a
            parameter before it waiting for its chunk; False waits for it in `step()`; see
            `Overlap`) and `cpu_offload`
            (bool, default False: fp32 masters, reduced gradients and optimizer state in host
            memory, the step on the host; see [Note: offload at stages 1 and 2] in
            engine/packing.py).
        warn_after_skipped_steps: warn when this many steps in a row were skipped for inf or
            nan gradients with no loss scale left to lower (see `ZeroOptimizer`).
        loss_scale: the seven scaler settings as one `LossScaleConfig`; the separate
            arguments refine it (one left at its default keeps loss_scale's value).
        step_in_backward: stage 3: step each sharded chunk during backward as soon as its
            reduced gradient is in (no clipping, no fp16; see `ZeroOptimizer`); None: the
            model's configuration says (`EngineConfig.overlap.step_in_backward`, default off).
    """
    if not isinstance(model, ZeroModel):
        raise TypeError(
            f"model must be the result of zero_model_wrapper, got {type(model).__name__}"
        )
    check_no_optimizer_yet(model)
    loss_scale = loss_scale_from(zero_optim_wrapper, locals(), loss_scale)
    if model.stage < 3 or optim_config:
        # Stages 1-2 pack their chunks now, with this bucket size (see [Note: packed once the
        # bucket size is known] in engine/packing.py); stage 3 refuses optim_config there.
        configured = front_door.with_optim_config(model.config, optim_config)
        if model.stage < 3:
            model.configure_reduction(configured)
    engine = wrap_optimizer(
        model,
        optimizer,
        loss_scale=loss_scale,
        max_norm=max_norm,
        norm_type=norm_type,
        warn_after_skipped_steps=warn_after_skipped_steps,
        step_in_backward=step_in_backward,
    )
    # Streams when the environment says where.
    telemetry.enable(model, engine, entry_point="zero_optim_wrapper")
    return engine


__all__ = ["GeminiDDP", "zero_model_wrapper", "zero_optim_wrapper"]
