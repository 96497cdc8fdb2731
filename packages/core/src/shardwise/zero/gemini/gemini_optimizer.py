"""GeminiOptimizer and GeminiAdamOptimizer (ColossalAI 0.5's names and constructors): a torch
optimizer over a `GeminiDDP`'s parameters, stepping its sharded fp32 masters."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwise import telemetry
from shardwise.amp import LossScaleConfig, loss_scale_from
from shardwise.amp.grad_scaler import LOSS_SCALE_KEYWORDS
from shardwise.engine.model import ZeroModel
from shardwise.engine.wrap import wrap_optimizer
from shardwise.gemini import AutoPlacement
from shardwise.nn.optimizer import HybridAdam
from shardwise.zero.optimizer_wrapper import ZeroOptimizerWrapper

# GeminiOptimizer's own keywords; GeminiAdamOptimizer hands the rest to HybridAdam.
_WRAPPER_KEYWORDS = (
    "gpu_margin_mem_ratio",
    *LOSS_SCALE_KEYWORDS,
    "max_norm",
    "norm_type",
    "tp_group",
    "params_info",
    "verbose",
    "loss_scale",
)


class GeminiOptimizer(ZeroOptimizerWrapper):
    """`optim` (any elementwise torch optimizer over `module.parameters()`, not yet stepped)
    stepping the sharded fp32 masters of `module`, a `GeminiDDP`: the loss is scaled in
    `backward` under fp16, the step clips to `max_norm` and skips on overflow on every rank.

    Args:
        optim: the torch optimizer.
        module: the GeminiDDP its parameters belong to.
        gpu_margin_mem_ratio: "auto" placement's share of the device room left after warm-up
            for optimizer state; it is the model's setting (GeminiPlugin's argument): 0.0 or
            the model's own value is accepted under "auto", another is refused; under other
            policies ColossalAI ignores it, and so does this, with a warning.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the fp16 loss scale (ColossalAI's defaults).
        max_norm, norm_type: clip the global gradient norm in the step (0: none).
        tp_group: refused unless None (no tensor parallelism).
        params_info: accepted; ColossalAI reads it only for tensor-parallel checkpoints.
        verbose: accepted (skipped steps are reported by a warning when they keep coming).
        loss_scale: beyond ColossalAI, by keyword: the seven loss-scale settings as one
            `LossScaleConfig` (as GeminiPlugin passes them), which the separate keywords
            refine (one left at its default keeps loss_scale's value).
        **defaults: ignored with a warning, as ColossalAI ignores them.
    """

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        module: nn.Module,
        gpu_margin_mem_ratio: float = 0.0,
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        tp_group: ProcessGroup | None = None,
        params_info: Any = None,
        verbose: bool = False,
        *,
        loss_scale: LossScaleConfig | None = None,
        **defaults: Any,
    ) -> None:
        name = type(self).__name__
        if defaults:
            # ColossalAI's takes and ignores them (its tests pass enable_async_reduce here,
            # GeminiAdamOptimizer the optimizer's lr): accepted, and named.
            warnings.warn(
                f"{name} ignores {sorted(defaults)}, as ColossalAI's does: set the optimizer's "
                f"hyper-parameters on the optimizer and the model's settings on GeminiDDP",
                UserWarning,
                stacklevel=2,
            )
        if not isinstance(module, ZeroModel) or module.stage != 3:
            raise TypeError(f"{name} needs the GeminiDDP its optimizer's parameters belong to")
        if tp_group is not None:
            raise ValueError(
                f"{name}: tp_group cannot be honoured: shardwise has no tensor parallelism; "
                f"leave it None"
            )
        _check_margin(name, module, gpu_margin_mem_ratio)
        engine = wrap_optimizer(
            module,
            optim,
            loss_scale=loss_scale_from(GeminiOptimizer.__init__, locals(), loss_scale),
            max_norm=max_norm,
            norm_type=norm_type,
        )
        # Streams when the environment says where.
        telemetry.enable(module, engine, entry_point="GeminiOptimizer")
        super().__init__(engine)
        self.module = module


class GeminiAdamOptimizer(GeminiOptimizer):
    """A `HybridAdam` over `model.parameters()` in a `GeminiOptimizer`.

    Args:
        model: the GeminiDDP.
        **defaults: GeminiOptimizer's keywords go to it (`initial_scale`, `max_norm`, ...),
            the others to HybridAdam (`lr`, `betas`, `eps`, `weight_decay`, ...).
    """

    def __init__(self, model: nn.Module, **defaults: Any) -> None:
        wrapper = {k: v for k, v in defaults.items() if k in _WRAPPER_KEYWORDS}
        adam = {k: v for k, v in defaults.items() if k not in _WRAPPER_KEYWORDS}
        super().__init__(HybridAdam(model.parameters(), **adam), model, **wrapper)


def _check_margin(name: str, module: ZeroModel, ratio: float) -> None:
    policy = module.config.placement.policy
    if isinstance(policy, AutoPlacement):
        if ratio not in (0.0, policy.margin_ratio):
            raise ValueError(
                f"{name}: gpu_margin_mem_ratio={ratio} differs from the model's "
                f"({policy.margin_ratio}), which placed it: build the model with "
                f"GeminiPlugin(placement_policy='auto', gpu_margin_mem_ratio={ratio})"
            )
    elif ratio:
        warnings.warn(
            f"{name}: gpu_margin_mem_ratio={ratio} is ignored: it applies to "
            f"placement_policy='auto' only, as in ColossalAI",
            UserWarning,
            stacklevel=3,
        )
