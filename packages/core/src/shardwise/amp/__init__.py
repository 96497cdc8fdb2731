"""Loss scaling for mixed-precision training."""

from shardwise.amp.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    GradScaler,
    LossScaleConfig,
    loss_scale_from,
)

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "GradScaler",
    "LossScaleConfig",
    "loss_scale_from",
]
