"""The precision plugin of the shardwise strategies.

Lightning's own plugins cast or autocast the user's module; under shardwise the engine owns the
dtypes (16-bit chunk payloads, fp32 master weights, compute dtype, loss scale), so this plugin
only names the dtypes, routes `backward` through the engine's loss scaler and steps the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import torch
from pytorch_lightning import LightningModule
from pytorch_lightning.plugins.precision import MixedPrecision as LightningMixedPrecision
from pytorch_lightning.plugins.precision import Precision
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from shardwise import MixedPrecision, ZeroOptimizer
from shardwise.engine.config import storage_precision
from shardwise_lightning.namespace import check_namespace, describe

PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed"]
PRECISIONS: tuple[str, ...] = ("32-true", "16-mixed", "bf16-mixed")
_PAYLOAD_DTYPES = {
    "32-true": torch.float32,
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
}


class ShardwisePrecision(Precision):
    """Mixed precision handled by the shardwise engine.

    "16-mixed" and "bf16-mixed" keep parameters in 16-bit chunks (stored and communicated in
    16 bits) with fp32 master weights in the optimizer; "16-mixed" turns on the engine's dynamic
    loss scale (the strategy's `initial_scale`, `growth_interval`, ... arguments). The compute
    dtype is the 16-bit one on CUDA and fp32 on the CPU, where 16-bit matrix math is slow.

    Args:
        precision: "32-true", "16-mixed" or "bf16-mixed".
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PRECISIONS:
            raise ValueError(
                f"shardwise strategies support precision {', '.join(map(repr, PRECISIONS))}, "
                f"got {precision!r}; for 16-bit weights without fp32 masters use another strategy"
            )
        self.precision = cast(PrecisionName, precision)

    def __repr__(self) -> str:
        return describe(self)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype parameters are stored and communicated in."""
        return _PAYLOAD_DTYPES[self.precision]

    def mixed_precision(self, device: torch.device) -> MixedPrecision:
        """The engine's dtypes for this precision on `device` (the compute dtype by the
        engine's rule for the device, `shardwise.engine.config.storage_precision`).

        Args:
            device: the compute device.
        """
        return storage_precision(self.dtype, device)

    def backward(  # type: ignore[override]
        self,
        tensor: Tensor,
        model: LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Backward of the loss times the engine's current loss scale."""
        if args or kwargs:
            raise TypeError(
                f"backward arguments {args or ''}{kwargs or ''} cannot be honoured: the engine "
                f"runs backward itself (gradients go straight to their chunks)"
            )
        _engine_optimizer(optimizer, model).backward(tensor)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (training step and backward), then the engine's step: unscale,
        overflow check on every rank, clip, step. Skipped when the closure skipped backward."""
        if kwargs:
            raise TypeError(f"optimizer.step() arguments {sorted(kwargs)} cannot be honoured")
        closure_result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and closure_result is None:
            return closure_result  # training_step returned None: nothing to step
        _engine_optimizer(optimizer, model).step()
        return closure_result

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: Any = None,
    ) -> None:
        """No-op: the engine clips the global norm inside its step (the strategy hands it
        `Trainer(gradient_clip_val=...)` as `max_norm`)."""

    def convert_module(self, module: Module) -> Module:
        return module  # the engine keeps the dtypes in its chunks


def _engine_optimizer(optimizer: Any, model: LightningModule) -> ZeroOptimizer:
    """The ZeroOptimizer behind `optimizer` (a LightningOptimizer or the engine's own), or the
    only one of the strategy when Lightning passes none (manual optimization)."""
    if optimizer is None:
        optimizers = model.trainer.strategy.optimizers
        if len(optimizers) != 1:
            raise ValueError(f"expected exactly one optimizer, found {len(optimizers)}")
        optimizer = optimizers[0]
    inner = getattr(optimizer, "_optimizer", optimizer)
    if not isinstance(inner, ZeroOptimizer):
        raise TypeError(
            f"the shardwise strategies step their own ZeroOptimizer, got {type(inner).__name__}"
        )
    return inner


def as_shardwise_precision(plugin: Precision | None) -> ShardwisePrecision | None:
    """Translate the plugin Lightning chose from `Trainer(precision=...)` into ours; refuse
    precisions the engine cannot honour."""
    if plugin is None or isinstance(plugin, ShardwisePrecision):
        return plugin
    check_namespace("the precision plugin", plugin, "this shardwise strategy")
    if type(plugin) is Precision:
        return ShardwisePrecision("32-true")
    if type(plugin) is LightningMixedPrecision:
        return ShardwisePrecision(plugin.precision)
    raise TypeError(
        f"shardwise strategies need their own precision plugin, got {type(plugin).__name__} "
        f"(precision {getattr(plugin, 'precision', '?')!r}); use Trainer(precision=...) with one "
        f"of {', '.join(map(repr, PRECISIONS))}, or ShardwisePrecision(...)"
    )
