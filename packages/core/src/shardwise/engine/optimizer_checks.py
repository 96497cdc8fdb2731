"""What `ZeroOptimizer` refuses: arguments it cannot honour, each with what to do instead."""

from __future__ import annotations

import torch

from shardwise.amp import DynamicGradScaler, GradScaler
from shardwise.engine.model import ZeroModel


def check_optimizer_arguments(
    model: object,
    optimizer: object,
    *,
    max_norm: object,
    norm_type: object,
    warn_after_skipped_steps: object,
) -> None:
    """Refuse a model not wrapped by the engine, an optimizer that is not torch's or has
    stepped already, and clipping or warning settings out of range."""
    if not isinstance(model, ZeroModel):
        raise TypeError(
            f"model must be wrapped by zero_model_wrapper first, got {type(model).__name__}"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if optimizer.state:
        raise ValueError(
            "optimizer already has state (it has stepped); wrap it before its first step"
        )
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float))
        or not max_norm >= 0  # also refuses nan, which would turn clipping off unseen
    ):
        raise ValueError(f"max_norm must be a number >= 0 (0 disables clipping), got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"norm_type must be a number > 0 or math.inf, got {norm_type!r}")
    if (
        isinstance(warn_after_skipped_steps, bool)
        or not isinstance(warn_after_skipped_steps, int)
        or warn_after_skipped_steps < 1
    ):
        raise ValueError(
            f"warn_after_skipped_steps must be an int >= 1, got {warn_after_skipped_steps!r}"
        )


def check_step_in_backward(
    step_in_backward: bool, model: ZeroModel, grad_scaler: GradScaler, max_norm: float
) -> None:
    """Refuse `step_in_backward` where a chunk's update depends on the whole gradient, or
    where no chunk could step during backward (see [Note: the optimizer steps during
    backward] in engine/backward_step.py)."""
    if not isinstance(step_in_backward, bool):
        raise TypeError(f"step_in_backward must be a bool, got {step_in_backward!r}")
    if not step_in_backward:
        return
    if model.stage != 3:
        raise ValueError(
            f"step_in_backward=True steps stage 3's sharded chunks during backward; at stage "
            f"{model.stage} every chunk keeps its parameters gathered and publishes them by an "
            f"all-gather at the step: use stage 3, or step_in_backward=False"
        )
    if max_norm > 0:
        raise ValueError(
            f"step_in_backward=True cannot clip (max_norm={max_norm}): clipping scales every "
            f"chunk by the whole gradient's norm, known only once backward has ended. Turn "
            f"clipping off (max_norm=0; Lightning: gradient_clip_val=None; the HF Trainer: "
            f"max_grad_norm=0), or use step_in_backward=False"
        )
    if isinstance(grad_scaler, DynamicGradScaler):
        raise ValueError(
            "step_in_backward=True cannot be used with fp16 loss scaling: a step is skipped "
            "when any rank's gradient overflowed, known only once backward has ended. Use "
            "bf16, or step_in_backward=False"
        )


__all__ = ["check_optimizer_arguments", "check_step_in_backward"]
