"""The three objects the Trainer's own loop calls in place of its defaults.

[Note: how the Trainer's loop reaches the engine]
transformers.Trainer runs forward, backward, clipping, `optimizer.step()` and the scheduler
inline. The callback hands it three objects that speak the interfaces it already calls:
- `TrainerModel` becomes `trainer.model_wrapped`: the Trainer then skips
  `accelerator.prepare(model)` (no DDP around sharded parameters) and its loop calls this
  module, whose forward runs the engine, compiled when `torch_compile` is set (accelerate's
  `prepare` would have compiled the model). Its `no_sync` is what accelerate calls between
  micro-batches of gradient accumulation (see [Note: gradient accumulation in the Trainer]).
- `TrainerOptimizer` becomes `trainer.optimizer` (accelerate wraps it like any optimizer, the
  LR scheduler steps its param groups, which are the inner optimizer's own dicts).
- `EngineLossScaler` becomes `trainer.accelerator.scaler`, the slot accelerate keeps for a
  torch GradScaler: `accelerator.backward` scales the loss with the engine's loss scale, and
  accelerate's optimizer learns from `step` whether the engine skipped the update on overflow,
  so the Trainer does not step the LR scheduler then, exactly as with its own fp16 scaler.
The Trainer's own clipping is replaced by one that does nothing (`.grad` is None at stages 2-3
and the average the engine clips itself at stage 1); `max_grad_norm` is the engine's clipping,
over the shards of all ranks.

[Note: gradient accumulation in the Trainer]
With `gradient_accumulation_steps` > 1 the Trainer runs each micro-batch's forward and backward
(`training_step`) inside `accelerator.no_sync(model)` for all but the last micro-batch of a step
(the last of an epoch's remainder included), and outside it for the last, unless accelerate's
`sync_each_batch` is set; accelerate's `no_sync` calls the model's own `no_sync` when training
runs distributed. `TrainerModel.no_sync` is the engine's at every stage, so each rank sums its
micro-batches' gradients locally and the last backward reduces that sum once, as DDP does under
the plain Trainer: fp32 results equal the plain Trainer's bit for bit until a step is clipped
(the engine's norm sums the shards in another order). The price is DDP's: at stage 3 each chunk
holds its whole (unsharded) gradient from the first micro-batch until the last reduces it.
To keep stage 3's gradients sharded between micro-batches instead (one reduction per
micro-batch, the sums then associating differently), set
`accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}}`: the Trainer
then calls no `no_sync` at all.

[Note: evaluation runs the user's model]
`evaluate()` and `predict()` (and evaluation inside `train()`) call `trainer.model`, the user's
model, not `model_wrapped`, under `torch.no_grad()`. The engine's hooks sit on that module (see
[Note: the inner module works on its own] in shardwise/engine/model.py): at stage 3 each chunk is
gathered before the modules that use it and released after its last use, inputs and outputs
are cast as for training, and no gradient reaches the chunks. The eval dataloader is sharded
over the ranks by the Trainer itself. What the Trainer would otherwise do first, when
accelerate has prepared no model (ours never goes through `accelerator.prepare`), is
`accelerator.prepare_model(trainer.model, evaluation_mode=True)`: that moves the model to the
device (replacing the tensors the chunks own, at stage 3 with host placement) and, under fp16 /
bf16 arguments, replaces its `forward` with an autocast one, which training would then run too.
`mark_prepared` sets the flag accelerate checks to skip exactly that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shardwise import ZeroModel, ZeroOptimizer

_STATE_MARKER = "shardwise"
_STATE_FORMAT = 1


def mark_prepared(model: nn.Module) -> None:
    """Tell accelerate `model` is prepared already, so the Trainer's evaluation does not place
    or autocast it (see [Note: evaluation runs the user's model])."""
    object.__setattr__(model, "_is_accelerate_prepared", True)


class TrainerModel(nn.Module):
    """The Trainer-facing wrapper of the engine.

    Args:
        engine: the wrapped model (`zero_model_wrapper`'s result around `trainer.model`).
        compile_options: `torch.compile`'s backend and mode when `TrainingArguments`'
            `torch_compile` is set: the engine is compiled as a whole, as accelerate would
            compile the model it prepares (see [Note: a model compiled as a whole] in
            shardwise/engine/model.py); None runs it eagerly.
    """

    _run: Callable[..., Any]

    def __init__(self, engine: ZeroModel, compile_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.engine = engine
        run = engine if compile_options is None else torch.compile(engine, **compile_options)
        # Not a submodule: it is the engine again (its state dict, its parameters).
        object.__setattr__(self, "_run", run)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Every micro-batch of a step but the last: gradients accumulate unreduced, and the
        last micro-batch's backward reduces their sum (see [Note: gradient accumulation in the
        Trainer])."""
        with self.engine.no_sync():
            yield


class TrainerOptimizer(torch.optim.Optimizer):
    """The engine's optimizer under the torch.optim.Optimizer interface the Trainer, accelerate
    and LR schedulers expect. Like accelerate's own wrapper it does not call
    `Optimizer.__init__`: its state lives in the wrapped optimizer.

    `state_dict()` is a marker: each rank's optimizer state is a shard, saved by the callback
    with `shardwise.checkpoint` next to the Trainer's checkpoint files.

    Args:
        zero: the engine's `ZeroOptimizer`.
    """

    def __init__(self, zero: ZeroOptimizer) -> None:
        self.zero = zero
        self._taken_by_scaler = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.zero.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.zero.optim.param_groups = value

    @property
    def state(self) -> Any:
        return self.zero.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self.zero.optim.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.zero.optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.zero.optim.defaults = value

    def engine_step(self) -> bool:
        """Unscale, check overflow on all ranks, clip, step the shards; then clear the
        gradients (the Trainer zeroes only `.grad`, which the engine does not use). Returns
        False when the step was skipped on overflow."""
        taken = self.zero.step()
        self.zero.zero_grad()
        return taken

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("a closure cannot be honoured: the engine steps sharded weights")
        if self._taken_by_scaler:
            # EngineLossScaler.step already stepped the engine; this call tells accelerate so.
            self._taken_by_scaler = False
            return
        self.engine_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return {_STATE_MARKER: {"format": _STATE_FORMAT, "where": "shardwise/ beside this file"}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        marker = state_dict.get(_STATE_MARKER) if isinstance(state_dict, dict) else None
        if not isinstance(marker, dict) or marker.get("format") != _STATE_FORMAT:
            raise ValueError(
                "this optimizer state was not saved by ShardwiseCallback (keys "
                f"{sorted(state_dict)[:5] if isinstance(state_dict, dict) else state_dict!r}); "
                "resume from a checkpoint written by a run with the callback"
            )
        # The sharded state itself is loaded by the callback when training begins.

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError("parameter groups cannot be added once the engine shards the optimizer")

    def __repr__(self) -> str:
        return f"TrainerOptimizer({self.zero!r})"


class EngineLossScaler:
    """The engine's loss scale behind the interface accelerate uses for a torch GradScaler.

    Args:
        optimizer: the Trainer-facing optimizer over the engine.
    """

    def __init__(self, optimizer: TrainerOptimizer) -> None:
        self.optimizer = optimizer

    @property
    def zero(self) -> ZeroOptimizer:
        return self.optimizer.zero

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self.zero.add_loss(loss)  # the Trainer's loss for telemetry
        scale = self.zero.loss_scale
        return loss * scale if scale != 1.0 else loss

    def unscale_(self, optimizer: Any) -> None:
        """Nothing to do: the engine unscales inside its step, fused with clipping."""

    def step(self, optimizer: Any, closure: Callable[[], float] | None = None) -> None:
        """Step the engine; call `optimizer.step()` (accelerate's marker of a taken step) only
        when the engine did not skip the update."""
        if closure is not None:
            raise ValueError("a closure cannot be honoured: the engine steps sharded weights")
        if self.optimizer.engine_step():
            self.optimizer._taken_by_scaler = True
            optimizer.step()

    def update(self, new_scale: float | None = None) -> None:
        if new_scale is not None:
            raise ValueError("the engine's loss scale is dynamic; it cannot be set by hand")

    def get_scale(self) -> float:
        return self.zero.loss_scale

    def is_enabled(self) -> bool:
        return True

    def state_dict(self) -> dict[str, Any]:
        return dict(self.zero.grad_scaler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.zero.grad_scaler.load_state_dict(state)
