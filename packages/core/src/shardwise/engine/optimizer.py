"""The optimizer side of ZeRO: a user's optimizer stepping this rank's fp32 master shards.

[Note: tensors without gradients]
A plain torch loop (`zero_grad()` setting grads to None) leaves a parameter that no gradient
reached out of the step: its value and its optimizer state (moments, step count, momentum)
stay as they are, and DDP with `find_unused_parameters=True` does the same for a parameter no
rank used. The chunks' gradient buffers hold zeros for such a tensor, which an optimizer would
still step (weight decay, momentum). So each chunk notes which tensors a gradient reached on
this rank since `zero_grad()`, the flags ride in the step's gradient-norm all-reduce (no extra
collective), and a tensor no rank flagged gets `.grad = None` on its shard view, which every
torch optimizer skips. A tensor some ranks flagged is stepped with the average over ranks, the
others contributing zeros, as DDP does.

[Note: the step, chunk by chunk]
After the one all-reduce that gives the global gradient norm and the overflow flag, the inner
optimizer steps each chunk's views on their own: its param groups are narrowed to the views of
one chunk, `step()` runs (torch's fused kernels over that chunk's master and state), and the
chunk publishes its updated parameters before the next chunk steps. Every elementwise optimizer
updates each element from that element's own state and the group's hyperparameters, so this is
bit-identical to one step over every view (tests/test_chunked_step.py holds it at every stage
and placement, clipping and fp16 overflow included); what changes is the working set: one
chunk's master, gradient and state at a time, so a chunk whose optimizer side lives elsewhere
(host memory, the disk tier) is brought in, stepped and sent back while the next one is
fetched, and the temporaries an optimizer makes per step (the foreach implementations' copies
of every moment) are one chunk's. Each chunk's step also adopts the state the optimizer made
for it (see [Note: the chunk owns its optimizer state] in chunk/optimizer_state.py). The param
groups hold every view again when the step returns, also when it raises, so state dicts and LR
schedulers see the whole optimizer; an inner optimizer's own step hooks run once per chunk.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardwise import comm
from shardwise.amp import ConstantGradScaler, DynamicGradScaler, GradScaler, LossScaleConfig
from shardwise.chunk import Chunk
from shardwise.engine.backward_step import StepsInBackward
from shardwise.engine.chunk_step import ChunkStepper
from shardwise.engine.disk_tier import (
    StepSnapshot,
    adopt_replaced_state,
    cloned_state,
    disk_chunks_for,
    release_disk,
    sides_in_memory,
)
from shardwise.engine.grad_norm import global_grad_norm
from shardwise.engine.model import ZeroModel
from shardwise.engine.optimizer_checks import check_optimizer_arguments, check_step_in_backward
from shardwise.engine.optimizer_registry import (
    check_no_optimizer_yet,
    register_optimizer,
    registered_optimizer,
    unregister_optimizer,
)
from shardwise.engine.shard_views import bind_shard_views
from shardwise.engine.skipped_steps import SkippedSteps, SkippedStepsWarning
from shardwise.engine.step_loop import step_chunks
from shardwise.engine.step_parts import step_parts
from shardwise.memory.disk_pool import DiskTierError


class ZeroOptimizer:
    """Mixed-precision, sharded optimizer step with loss scaling and clipping across shards.

    Args:
        model: the `ZeroModel` whose parameters `optimizer` was built over.
        optimizer: any elementwise torch optimizer, not yet stepped.
        grad_scaler: the loss scaler (dynamic for fp16, constant otherwise).
        max_norm: clip the global gradient norm to this value; 0 disables clipping.
        norm_type: the norm used for clipping (2.0, inf, or any p > 0).
        warn_after_skipped_steps: warn (`SkippedStepsWarning`, and in telemetry) once this
            many steps in a row were skipped for non-finite gradients while the loss scale
            could not back off any further (fp32 and bf16 always; fp16 at `min_scale`), and
            again every as many steps after: training then makes no progress.
        step_in_backward: step each of stage 3's sharded chunks during backward, as soon as
            its reduced gradient is in, and only the rest in `step()` (see [Note: the
            optimizer steps during backward] in engine/backward_step.py): the same update,
            overlapped with backward. Needs no clipping and no fp16 loss scaling; gradient
            accumulation needs `no_sync()`; a non-finite gradient is stepped, not skipped.
            None: the model's `EngineConfig.overlap.step_in_backward`.
    """

    def __init__(
        self,
        model: ZeroModel,
        optimizer: torch.optim.Optimizer,
        *,
        grad_scaler: GradScaler,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        warn_after_skipped_steps: int = 10,
        step_in_backward: bool | None = None,
    ) -> None:
        check_optimizer_arguments(
            model,
            optimizer,
            max_norm=max_norm,
            norm_type=norm_type,
            warn_after_skipped_steps=warn_after_skipped_steps,
        )
        if step_in_backward is None:
            step_in_backward = model.config.overlap.step_in_backward
        check_step_in_backward(step_in_backward, model, grad_scaler, max_norm)
        check_no_optimizer_yet(model)
        self.model = model
        # What the step uses of the model, handed over once (see engine/step_parts.py).
        self._parts = step_parts(model)
        self.optim = optimizer
        self.grad_scaler = grad_scaler
        self.max_norm = float(max_norm)
        self.norm_type = float(norm_type)
        self.last_grad_norm = 0.0
        self.last_step_skipped = False
        # This step's loss as telemetry reports it: the sum of the losses handed to backward
        # since the last step (see add_loss).
        self.step_loss: torch.Tensor | None = None
        self.last_loss_scale = grad_scaler.scale
        self.num_steps = 0
        self._replan_after_step = False
        self._skips = SkippedSteps(warn_after_skipped_steps)
        self._scaler_before: dict[str, Any] = {}
        self._skips_before = self._skips.snapshot()
        self._closed = False
        self._step_hooks: list[Callable[[ZeroOptimizer], None]] = []
        self._chunks: list[Chunk] = list(model.chunk_manager.trainable_chunks())
        for chunk in self._chunks:
            # Each reduction takes its share of the norm this optimizer's step reads (see
            # [Note: norm partials] in chunk/norm_partial.py).
            chunk.grads.norm_type = self.norm_type
        # See [Note: the optimizer sees shard views] in engine/shard_views.py.
        views = bind_shard_views(optimizer, model.chunk_manager, self._chunks)
        self._slots = views.slots
        self._stepper = ChunkStepper(optimizer, views.slots, views.groups_of_chunk)
        # Parameter name -> the shard view the inner optimizer steps (checkpoints use it).
        self.shard_views = views.by_name
        # Every group's parameters by name, in the order the user gave them (frozen ones and
        # ones this rank owns no element of too): torch's parameter numbers in checkpoints.
        self.group_param_names = views.group_param_names
        # The disk tier (see [Note: the disk tier] in memory/disk_pool.py).
        self._disk_chunks, self.disk = disk_chunks_for(
            self._chunks,
            model.config.placement,
            optimizer,
            comm.rank(model.config.topology.process_group),
        )
        # See [Note: the optimizer steps during backward] in engine/backward_step.py.
        if step_in_backward and not any(StepsInBackward.could_step(c) for c in self._chunks):
            if self.disk is not None:
                release_disk(self._disk_chunks, self.disk)
            raise ValueError(
                "step_in_backward=True, but no chunk can step during backward: every chunk "
                "keeps its parameters gathered (shard_param_frac < 1 keeps the rest gathered) "
                "or has its optimizer side on the disk tier. Shard the chunks, keep their "
                "sides in memory, or use step_in_backward=False"
            )
        self._in_backward = StepsInBackward() if step_in_backward else None
        # How many chunks stepped during the backward passes of the last step (this rank).
        self.last_stepped_in_backward = 0
        if self._in_backward is not None:
            stepper = weakref.WeakMethod(self._step_reduced)

            def step_reduced(chunk: Chunk) -> None:
                method = stepper()
                if method is not None:  # else this optimizer is gone
                    method(chunk)

            self._parts.runtime.step_reduced_in_backward(step_reduced)
        register_optimizer(model, self)

    def close(self) -> None:
        """Detach from the model so that another optimizer can be wrapped over it (a second
        `fit` with a new optimizer); this one can no longer step. Masters and state on the
        disk tier come back into host memory and its files are removed."""
        if self._in_backward is not None and not self._closed:
            self._parts.runtime.step_reduced_in_backward(None)
        unregister_optimizer(self.model, self)
        if self.disk is not None and not self._closed:
            release_disk(self._disk_chunks, self.disk)
        self._closed = True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def warn_after_skipped_steps(self) -> int:
        return self._skips.warn_after

    @property
    def skipped_in_a_row(self) -> int:
        """Steps skipped in a row for non-finite gradients, up to the last one."""
        return self._skips.in_a_row

    @property
    def skip_warning(self) -> str | None:
        """The `SkippedStepsWarning` last given while steps keep being skipped, else None."""
        return self._skips.warning

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` times the current loss scale; gradients reach the shards."""
        scale = self.grad_scaler.scale
        self.add_loss(loss)
        (loss * scale if scale != 1.0 else loss).backward()

    def add_loss(self, loss: torch.Tensor) -> None:
        """Count `loss`, as handed to backward, in this step's loss (`step_loss`, which
        telemetry reports): the sum over the step's micro-batches, so under gradient
        accumulation it is their mean when each was divided by the number of micro-batches,
        as the HF Trainer and Lightning divide it: the loss they log."""
        loss = loss.detach()
        self.step_loss = loss if self.step_loss is None else self.step_loss + loss

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        scale = self.grad_scaler.scale
        torch.autograd.backward(tensor, grad * scale if scale != 1.0 else grad)

    def step(self) -> bool:
        """Unscale, check for overflow on any rank, clip, step, and publish the new weights.

        Returns False when the step was skipped because some rank's gradient overflowed (the
        loss scale then backs off as its hysteresis says); True otherwise.
        """
        if self._closed:
            raise ValueError("this ZeroOptimizer was closed; step the one that replaced it")
        parts = self._parts
        parts.runtime.settle()
        stepped_early = self._take_stepped_in_backward()
        parts.reducer.reduce_all()
        # A chunk whose share of the norm is taken is read only when it steps, so its
        # gradient's copy to the host can still be landing (see [Note: norm partials] in
        # chunk/norm_partial.py); the others are read now, for the norm.
        partials = [chunk.grads.norm_partial for chunk in self._chunks]
        grads: list[torch.Tensor | None] = [
            chunk.grads.for_step() if partial is None else None
            for chunk, partial in zip(self._chunks, partials, strict=True)
        ]
        scale = self.grad_scaler.scale
        rank_sync = parts.rank_sync
        reduced = global_grad_norm(
            [
                grad if grad is not None else chunk.grads.shard
                for chunk, grad in zip(self._chunks, grads, strict=True)
            ],
            self.norm_type,
            parts.comm_stats,
            parts.process_group,
            parts.device,
            signature=rank_sync.step_signature(),
            # The last flag: did "auto" placement overrun its plan on this rank (any rank's
            # makes every rank plan again after this step, see _after_step)?
            got_grad=[*self._got_grad_flags(), self._overran_plan()],
            replicas=parts.replicas,
            partials=partials,
        )
        rank_sync.step_checked(reduced.ranks_agree)
        self._replan_after_step = reduced.got_grad[-1]
        norm = reduced.norm / scale
        self.last_grad_norm = norm
        self.last_loss_scale = scale
        overflow = not math.isfinite(norm)
        if overflow and self._in_backward is not None:
            # See [Note: the optimizer steps during backward]: stepped as torch would.
            warnings.warn(
                f"the gradient norm is {norm} and step_in_backward=True steps it as it is "
                f"(a step can be skipped only when nothing stepped during backward): check "
                f"the loss and inputs for inf/nan, or use step_in_backward=False",
                RuntimeWarning,
                stacklevel=2,
            )
            overflow = False
        # What a rolled-back step of the disk tier restores (see engine/step_loop.py).
        self._scaler_before = self.grad_scaler.state_dict() if self.disk is not None else {}
        self._skips_before = self._skips.snapshot()
        self._skips.count(overflow, self.grad_scaler)
        self.grad_scaler.update(overflow)
        self.last_step_skipped = overflow
        if overflow:
            self.zero_grad()
            for chunk in self._chunks:
                chunk.grads.end_step()
            self._after_step()
            return False
        coef = 1.0 / scale
        if self.max_norm > 0:
            # As torch.nn.utils.clip_grad_norm_: never scale up, epsilon against zero norms.
            coef *= min(1.0, self.max_norm / (norm + 1e-6))
        self._step_chunk_by_chunk(coef, grads, reduced.got_grad, stepped_early)
        self._after_step()
        return True

    def _take_stepped_in_backward(self) -> set[int]:
        """The chunks that stepped during this step's backward passes (see [Note: the
        optimizer steps during backward] in engine/backward_step.py)."""
        if self._in_backward is None:
            return set()
        stepped = self._in_backward.take(
            self.optim.param_groups, gradients_left=self._parts.reducer.has_unreduced_passes
        )
        self.last_stepped_in_backward = len(stepped)
        return stepped

    def _step_reduced(self, chunk: Chunk) -> None:
        """Step `chunk` during backward, its gradient just reduced, where it may (see [Note:
        the optimizer steps during backward] in engine/backward_step.py)."""
        tracker = self._in_backward
        assert tracker is not None
        tracker.check_not_stepped(chunk)
        if chunk.chunk_id not in self._slots or not tracker.may_step(chunk):
            return
        # Every tensor of it got a gradient on this rank: no flag is needed from the others.
        self._stepper.step(chunk, chunk.grads.for_step(), 1.0 / self.grad_scaler.scale)
        chunk.publish_master()
        tracker.record(chunk, self.optim.param_groups)

    def _step_chunk_by_chunk(
        self,
        coef: float,
        grads: list[torch.Tensor | None],
        got_grad: list[bool],
        stepped_early: set[int],
    ) -> None:
        """See [Note: the step, chunk by chunk]; `grads` are the chunks' gradient shards
        where the norm read them already (the others are read as each chunk steps: its host
        step runs while later chunks' gradients may still be landing, see [Note: reduced
        gradients leave for the host] in chunk/grads.py). One loop for every tier (see [Note:
        the disk tier in the step] in engine/step_loop.py): when the disk tier's step fails,
        nothing else has stepped, and the step is undone. The chunks in `stepped_early` (ids)
        stepped during backward already."""
        read = {chunk.chunk_id: grad for chunk, grad in zip(self._chunks, grads, strict=True)}

        def step(chunk: Chunk) -> None:
            grad = read[chunk.chunk_id]
            grad = chunk.grads.for_step() if grad is None else grad
            self._stepper.step(chunk, grad, coef, got_grad)

        for chunk in self._chunks:
            if chunk.chunk_id in stepped_early:
                chunk.grads.end_step()
        left = [chunk for chunk in self._chunks if chunk.chunk_id not in stepped_early]
        fallible = [chunk for chunk in left if chunk.tier.fallible]
        snapshot = (
            StepSnapshot.take(fallible, self.optim.state, self._scaler_before) if fallible else None
        )
        try:
            step_chunks(
                left,
                step,
                wait_publish=not self._parts.defers_param_gather,
                stats=self._parts.comm_stats,
                group=self._parts.data_parallel,
            )
        except DiskTierError:
            assert snapshot is not None
            snapshot.restore(self.optim.state)
            self.grad_scaler.load_state_dict(snapshot.scaler)
            self._skips.restore(self._skips_before)
            raise

    def _overran_plan(self) -> bool:
        gemini = self._parts.gemini
        return gemini is not None and gemini.overran_since_plan

    def _got_grad_flags(self) -> list[bool]:
        """Per trainable tensor, in chunk order: did a gradient reach it on this rank since
        zero_grad()? See [Note: tensors without gradients]."""
        flags: list[bool] = []
        for chunk in self._chunks:
            received, count = chunk.grads.received, len(chunk.tensors)
            if len(received) == count:
                flags.extend([True] * count)
            else:
                flags.extend(index in received for index in range(count))
        return flags

    def add_step_hook(self, hook: Callable[[ZeroOptimizer], None]) -> None:
        """Call `hook(optimizer)` after every step, taken or skipped (telemetry uses it)."""
        self._step_hooks.append(hook)

    def _after_step(self) -> None:
        gemini = self._parts.gemini
        if self._replan_after_step and gemini is not None:
            self._replan_after_step = False
            gemini.replan()
        self.num_steps += 1
        for hook in self._step_hooks:
            hook(self)
        self.step_loss = None  # the next step's micro-batches add up from zero

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards (they are kept allocated: `set_to_none` is accepted for
        compatibility and zeroes all the same); a backward pass that raised midway is
        forgotten with them (see [Note: the phase of the pass] in runtime/phase.py)."""
        self._parts.runtime.forget()
        if self._in_backward is not None and self._in_backward.stepped:
            stepped = self._in_backward.forget()
            warnings.warn(
                f"zero_grad() without step(): {len(stepped)} chunks had stepped during "
                f"backward already (step_in_backward=True) and keep that step",
                RuntimeWarning,
                stacklevel=2,
            )
            for chunk in self._chunks:
                if chunk.chunk_id in stepped:
                    chunk.grads.end_step()
        for chunk in self._chunks:
            chunk.grads.zero_grad()

    @contextmanager
    def optim_sides_in_memory(self) -> Iterator[None]:
        """Every master and optimizer state readable in memory inside the block: those on the
        disk tier are read in, and dropped again on leaving (their disk copies unchanged).
        Elsewhere nothing happens. Checkpoints of the optimizer read its state inside it."""
        with sides_in_memory(self._disk_chunks):
            yield

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its shards) and the loss scaler's state (copies of
        the state on the disk tier)."""
        with self.optim_sides_in_memory():
            inner = self.optim.state_dict()
            if self.disk is not None:
                inner = {**inner, "state": cloned_state(inner["state"])}
        return {"optimizer": inner, "grad_scaler": self.grad_scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state["optimizer"])
        self.grad_scaler.load_state_dict(state["grad_scaler"])
        self.state_replaced()

    def state_replaced(self) -> None:
        """The inner optimizer's state was replaced (loaded): let each chunk adopt the new
        tensors now, so the old ones are freed and the new ones move with the chunk (see
        [Note: the chunk owns its optimizer state] in chunk/optimizer_state.py); those on the
        disk tier write it through at once."""
        adopt_replaced_state(self._chunks, self.optim.state)

    def state_bytes(self) -> int:
        """Bytes of optimizer state (e.g. Adam moments) this rank holds in memory."""
        return sum(self.chunk_state_bytes(chunk) for chunk in self._chunks)

    def chunk_state_bytes(self, chunk: Chunk) -> int:
        """Bytes of optimizer state held in memory for the parameters of `chunk` on this
        rank."""
        return chunk.optimizer_state.nbytes()

    def __repr__(self) -> str:
        name = type(self.optim).__name__
        return f"ZeroOptimizer(stage={self.model.stage}, optim={name}, scale={self.loss_scale})"


def optimizer_of(model: ZeroModel) -> ZeroOptimizer | None:
    """The optimizer wrapped over `model`, while it is alive and not closed."""
    found = registered_optimizer(model)
    return found if isinstance(found, ZeroOptimizer) else None


def grad_scaler_for(model: ZeroModel, loss_scale: LossScaleConfig) -> GradScaler:
    """A DynamicGradScaler with `loss_scale` when any of the model's dtypes is fp16, otherwise
    a constant scale of 1 (the settings were validated all the same, when built)."""
    if model.config.precision.uses_loss_scaling:
        return DynamicGradScaler.from_config(loss_scale)
    return ConstantGradScaler()


__all__ = [
    "SkippedStepsWarning",
    "ZeroOptimizer",
    "check_no_optimizer_yet",
    "grad_scaler_for",
    "optimizer_of",
]
