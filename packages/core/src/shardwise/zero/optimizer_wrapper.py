"""The engine's `ZeroOptimizer` seen through ColossalAI's `OptimizerWrapper`: the boosted
optimizer of GeminiPlugin and LowLevelZeroPlugin, and the base of ColossalAI's
`GeminiOptimizer` and `LowLevelZeroOptimizer`."""

from __future__ import annotations

from typing import Any

import torch

from shardwise.checkpoint.optimizer_checkpoint import OptimizerCheckpoint
from shardwise.checkpoint.zero_optimizer_io import load_zero_optimizer, zero_optimizer_state_dict
from shardwise.engine.optimizer import ZeroOptimizer
from shardwise.interface import OptimizerWrapper


class ZeroOptimizerWrapper(OptimizerWrapper):
    """Steps the sharded fp32 masters of a ZeRO model (`engine`): the loss is scaled in
    `backward` under fp16, the step clips with the plugin's `max_norm` (or, once, with
    `clip_grad_by_norm`'s) and skips on overflow on every rank, as ColossalAI's Gemini and
    LowLevelZero optimizers do. `unwrap()` is the user's torch optimizer; LR schedulers built on
    it keep driving the step."""

    def __init__(self, engine: ZeroOptimizer) -> None:
        super().__init__(engine.optim)
        self.engine = engine
        self._clip_once: tuple[float, float] | None = None
        self._last_norm_type = engine.norm_type

    def step(self, *args: Any, **kwargs: Any) -> bool:
        """One optimizer step over every rank's shards; False when it was skipped (fp16
        overflow)."""
        if args or kwargs:
            raise TypeError(
                f"step() takes no arguments here (got {len(args)} positional and "
                f"{sorted(kwargs)}): the engine's step needs no closure"
            )
        if self._clip_once is None:
            self._last_norm_type = self.engine.norm_type
            return self.engine.step()
        self._last_norm_type = self._clip_once[1]
        kept = self.engine.max_norm, self.engine.norm_type
        self.engine.max_norm, self.engine.norm_type = self._clip_once
        try:
            return self.engine.step()
        finally:
            self.engine.max_norm, self.engine.norm_type = kept
            self._clip_once = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def backward(
        self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False, **kwargs: Any
    ) -> None:
        if inputs is not None or retain_graph or kwargs:
            raise ValueError(
                "backward(loss) of a ZeRO optimizer takes the loss alone: the engine reduces "
                "every parameter's gradient, so inputs=, retain_graph= and other autograd "
                "arguments cannot be honoured"
            )
        self.engine.backward(loss)

    def backward_by_grad(
        self,
        tensor: torch.Tensor,
        grad: torch.Tensor,
        inputs: Any = None,
        retain_graph: bool = False,
    ) -> None:
        if inputs is not None or retain_graph:
            raise ValueError("backward_by_grad of a ZeRO optimizer takes the tensor and grad alone")
        self.engine.backward_by_grad(tensor, grad)

    def clip_grad_by_norm(  # type: ignore[override]  # the norm is known at the step
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Clip the next step's gradients to `max_norm` (instead of the plugin's), once. The
        gradients live sharded until the step, where their global norm is computed over every
        rank; `get_grad_norm()` after the step returns it. (ColossalAI's Gemini optimizer only
        warns here.)"""
        if error_if_nonfinite or args or kwargs:
            raise ValueError(
                "clip_grad_by_norm takes max_norm and norm_type here; a non-finite norm skips "
                "the step on every rank instead of raising"
            )
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self._clip_once = (float(max_norm), float(norm_type))

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "clip_grad_by_value is not offered for sharded gradients: clip by norm "
            "(the plugin's max_norm, or clip_grad_by_norm)"
        )

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs: Any) -> float:
        """The global gradient norm of the last step, before clipping, in the norm that step
        clipped with (the plugin's `norm_type`, or `clip_grad_by_norm`'s)."""
        if float(norm_type) != self._last_norm_type:
            raise ValueError(
                f"the last step computed the {self._last_norm_type}-norm, not the "
                f"{norm_type}-norm: set the plugin's norm_type to the norm you read"
            )
        return float(self.engine.last_grad_norm)

    def state_dict(self, only_rank_0: bool = True) -> dict[str, Any]:  # type: ignore[override]
        """torch's optimizer state dict of the whole model, as a plain optimizer over the
        unsharded model would give it: exactly `state` (whole shapes, parameters numbered in
        the order they were given) and `param_groups`, as ColossalAI's (the loss scaler's
        state is `loss_scaler_state_dict()`'s, and rides in the Booster's checkpoints); with
        `only_rank_0` the other ranks get an empty dict. A collective: every rank calls it."""
        return zero_optimizer_state_dict(self.engine, only_rank_0=only_rank_0)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a whole-shape optimizer state dict (`state_dict()`'s, or a torch optimizer's
        over the same parameters); every rank takes the elements it owns. A `loss_scaler`
        entry, as older state dicts carried, is loaded too."""
        load_zero_optimizer(self.engine, OptimizerCheckpoint.of_state_dict(state_dict))

    def loss_scaler_state_dict(self) -> dict[str, Any]:
        """The loss scaler's state (its scale and counters), the same on every rank."""
        return self.engine.grad_scaler.state_dict()

    def load_loss_scaler_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the loss scaler from `loss_scaler_state_dict()`'s result."""
        self.engine.grad_scaler.load_state_dict(state)

    @property
    def loss_scale(self) -> float:
        return self.engine.loss_scale
