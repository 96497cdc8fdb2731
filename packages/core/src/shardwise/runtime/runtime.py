"""The parts that run a wrapped model's passes, built and driven by one object.

A `Runtime` builds, in order, the gather units and schedule (stage 3), the deferred parameter
gathers (stages 1 and 2) and the gradient reducer, each given what it needs when it is built;
it then drives every pass: the model's root hooks call `before_forward` / `after_forward`,
the first of the parts' hooks a backward pass reaches calls `enter_backward`, which queues the
one end of backward on autograd (see [Note: one end of backward] in runtime/backward_end.py),
and a pass left in a backward phase by an exception is settled before anything else runs (see
[Note: the phase of the pass] in runtime/phase.py).

It owns every hook those parts put on the user's module and tensors (see [Note: one owner of
an engine's hooks] in runtime/hooks.py) and removes them when closed, or when it is collected:
the hooks torch keeps in C++ hold the engine only weakly (see [Note: hooks hold the engine
weakly] in runtime/grad_reducer.py), so a dropped model is collected, and a tensor the user
kept (a parameter in a list, an EMA copy's source) carries no dead hook of it afterwards. The
runtime starts no thread: the disk tier's threads belong to its pool (memory/disk_pool.py) and
telemetry's to its emitter, each stopped when its owner is collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.chunk import Chunk, ChunkManager
from shardwise.gemini import GeminiManager
from shardwise.runtime.gather_scheduler import GatherScheduler
from shardwise.runtime.gather_units import UnitMap
from shardwise.runtime.grad_reducer import GradReducer
from shardwise.runtime.hooks import HookSet
from shardwise.runtime.param_gather import DeferredParamGather
from shardwise.runtime.phase import PassState, Phase
from shardwise.runtime.rank_sync import RankSync, VisitTrail
from shardwise.runtime.unit_plan import plan_gather_units


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeSettings:
    """What the runtime's parts do, as the engine's configuration decided it.

    Attributes:
        device: the compute device (where the ranks' pass checks travel).
        conditional_units: stage 3's blocks gathered as one (see [Note: conditional units] in
            runtime/gather_units.py); None at stages 1 and 2, which have no gather schedule.
        prefetch: stage 3 gathers the next chunk of the recorded order ahead.
        prefetch_chunks: how many chunks ahead.
        defers_param_gather: stages 1-2 leave the step's parameter all-gathers to the next
            forward (see [Note: deferred parameter gathers] in runtime/param_gather.py).
        reduce_in_backward: gradients are reduced during backward (see `GradReducer`).
        overlap_reductions: those reductions run in the background of backward.
        max_in_flight: at most this many reductions run at once.
        bucket_bytes: consecutive chunks share a reduction up to this many bytes (0: none).
    """

    device: torch.device
    conditional_units: dict[str, nn.Module] | None
    prefetch: bool
    prefetch_chunks: int
    defers_param_gather: bool
    reduce_in_backward: bool
    overlap_reductions: bool
    max_in_flight: int
    bucket_bytes: int


class Runtime:
    """A wrapped model's gather schedule, deferred gathers and gradient reducer, the phase of
    its pass, and the hooks they installed (`hooks`).

    Args:
        module: the user's model, its parameters packed into `chunk_manager`.
        chunk_manager: its chunks.
        gemini: the memory manager placing them, if any.
        settings: what the parts do.
        rank_sync: the ranks' pass checks, told when each pass starts.
        trail: the modules stage 3's hooks ran, for those checks.
        hooks: where every hook of the parts is kept.
    """

    def __init__(
        self,
        module: nn.Module,
        chunk_manager: ChunkManager,
        gemini: GeminiManager | None,
        settings: RuntimeSettings,
        *,
        rank_sync: RankSync,
        trail: VisitTrail | None,
        hooks: HookSet,
    ) -> None:
        self.hooks = hooks
        self.state = PassState()
        self._gemini = gemini
        self._rank_sync = rank_sync
        self._device = settings.device
        self._warmed_up = False  # a backward pass ended (stage 3's memory manager learnt)
        self._forwards_in_backward = 0  # see before_forward
        self._forward_was_recorded = False
        self._releases_reduced = settings.conditional_units is not None
        # See [Note: stepping during backward]: chunks reduced in this pass, and what steps
        # them when the pass reaches a safe point.
        self._reduced_in_pass: list[Chunk] = []
        self._step_reduced: Callable[[Chunk], None] | None = None
        conditional = settings.conditional_units
        # 1. Stage 3's conditional units: their backward signals the reducer (unit_done).
        units = (
            UnitMap(module, chunk_manager, conditional, on_done=self._unit_done)
            if conditional is not None
            else None
        )
        # 2. The reducer, first: the schedule finishes its reductions to make room. At stage
        # 3 a chunk's gathered parameters are released as soon as its gradients are complete
        # (see [Note: gradients in flight] in runtime/grad_reducer.py).
        self.reducer = GradReducer(
            chunk_manager,
            reduce_in_backward=settings.reduce_in_backward,
            overlap=settings.overlap_reductions,
            max_in_flight=settings.max_in_flight,
            bucket_bytes=settings.bucket_bytes,
            on_reduced=self._reduced,
            on_complete=release_if_idle if units is not None else None,
            gemini=gemini,
            units=units,
            enter_backward=self.enter_backward,
            hooks=hooks.part(),
        )
        # 3. The gather schedule (stage 3).
        self.scheduler: GatherScheduler | None = None
        if units is not None:
            assert conditional is not None
            self.scheduler = GatherScheduler(
                module,
                chunk_manager,
                plan=lambda used_in, blocks: plan_gather_units(
                    module, chunk_manager, conditional, used_in, blocks=blocks
                ),
                state=self.state,
                prefetch=settings.prefetch,
                prefetch_chunks=settings.prefetch_chunks,
                gemini=gemini,
                reductions=self.reducer,
                units=units,
                trail=trail,
                enter_backward=self.enter_backward,
                hooks=hooks.part(),
            )
        # 4. The deferred gathers of updated parameters (stages 1 and 2).
        self.param_gather = (
            DeferredParamGather(module, chunk_manager, hooks.part())
            if settings.defers_param_gather
            else None
        )
        # The finalizer holds the hook set alone (handles, which hold no part of the engine),
        # so it keeps nothing alive and runs once: at close() or at collection.
        self._remove_hooks = weakref.finalize(self, hooks.remove)

    @property
    def phase(self) -> Phase:
        return self.state.phase

    # ---- the pass ----------------------------------------------------------------------------

    def before_forward(self, *, wait_param_gathers: bool) -> None:
        """The model's root forward is about to run (`wait_param_gathers`: every deferred
        parameter gather first, for a model holding compiled code)."""
        if self.state.phase is Phase.PRE_BACKWARD and _inside_backward():
            # The root re-run by reentrant activation checkpointing: still the backward pass.
            self._forwards_in_backward += 1
        else:
            self.settle()
            self.state.phase = Phase.FORWARD
        if wait_param_gathers and self.param_gather is not None:
            self.param_gather.wait_all()
        # Before any gather of this pass: see [Note: ranks in step] in runtime/rank_sync.py.
        self._rank_sync.forward_started(self._device)
        scheduler = self.scheduler
        if scheduler is not None:
            self._forward_was_recorded = bool(scheduler.forward_order())
            scheduler.begin_forward()
            if self._gemini is not None:
                self._gemini.begin_forward()
            scheduler.root_pre_forward()

    def after_forward(self, output: Any) -> None:
        """The model's root forward has run, or raised."""
        self.wait_param_gathers()
        scheduler = self.scheduler
        if scheduler is not None:
            scheduler.root_post_forward(output)
            if self._gemini is not None:
                self._gemini.end_forward()
            scheduler.end_forward()
            if not self._forward_was_recorded:
                # Backward meets chunks roughly in reverse forward order: reduce them so.
                self.reducer.suggest_order(scheduler.forward_order()[::-1])
        if self._forwards_in_backward:
            self._forwards_in_backward -= 1
        else:
            self.state.phase = Phase.IDLE

    def enter_backward(self) -> None:
        """A hook of a part was reached by a backward pass: the first of the pass queues its
        end on autograd and starts the backward's gathers and checks."""
        if self.state.phase is Phase.PRE_BACKWARD:
            self._step_reduced_chunks()
            return
        self.settle()
        self.state.phase = Phase.PRE_BACKWARD
        # Autograd runs this when the pass ends, once; a pass that raises never runs it.
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._rank_sync.backward_started(self._device)
        if self.scheduler is not None:
            self.scheduler.begin_backward()

    def _end_backward(self, completed: bool = True) -> None:
        # Autograd finished the pass (see [Note: one end of backward]): the schedule's
        # releases, the memory manager's plan after the first, then the reductions left. A
        # pass that raised (`completed` False) records no order and teaches no plan.
        self.state.phase = Phase.POST_BACKWARD
        if self.scheduler is not None:
            self.scheduler.end_backward(completed=completed)
            if self._gemini is not None and not self._warmed_up:
                if completed:
                    self._warmed_up = True
                    self._gemini.end_of_warmup()
                else:
                    self._gemini.restart_warmup()
        self.reducer.end_of_backward()
        if completed:
            self._step_reduced_chunks()
        self._reduced_in_pass.clear()
        self.state.phase = Phase.IDLE

    # [Note: stepping during backward]
    # Where the step needs nothing global before a chunk steps (no clipping, no fp16 overflow
    # check: `ZeroOptimizer(step_in_backward=True)`), a chunk can step as soon as its reduced
    # gradient is in, while backward goes on: its host step then overlaps the backward of the
    # chunks before it. The reducer ends reductions at moments that differ between ranks (the
    # memory manager may wait for them to make room), sometimes inside the memory manager's
    # decisions, so a chunk reduced in a pass is only noted there; the runtime steps the
    # noted chunks at the next point of the pass that is safe on every rank: the next hook a
    # backward reaches (before it adds a gradient or gathers), and the end of a backward that
    # completed. Stepping one chunk issues no collective (its own shard, published into its
    # own payload), so ranks need not step it at the same moment. A pass that raised steps
    # nothing more; what it stepped before it raised stays stepped.

    def step_reduced_in_backward(self, step: Callable[[Chunk], None] | None) -> None:
        """Call `step(chunk)` for each chunk reduced in a backward pass, at the pass's next
        safe point (see [Note: stepping during backward]); None stops it."""
        self._step_reduced = step

    def _reduced(self, chunk: Chunk) -> None:
        if self._releases_reduced:
            release_if_idle(chunk)
        if self._step_reduced is not None and self.state.phase.in_backward:
            self._reduced_in_pass.append(chunk)

    def _step_reduced_chunks(self) -> None:
        step = self._step_reduced
        while self._reduced_in_pass and step is not None:
            step(self._reduced_in_pass.pop(0))

    def _unit_done(self, unit: int) -> None:
        self.reducer.unit_done(unit)

    # ---- a pass that raised (see [Note: the phase of the pass]) -------------------------------

    def settle(self) -> None:
        """Before anything but a backward runs: a backward pass that raised before autograd
        ended it is ended now, as autograd would have (its partial gradients reduced and kept,
        as a plain torch loop keeps them in `.grad`). A collective, which every rank reaches
        alike when every rank caught the same exception."""
        if self.state.phase is Phase.PRE_BACKWARD:
            self._end_backward(completed=False)
        elif self.state.phase is Phase.POST_BACKWARD:  # the end itself raised
            self.forget()

    def forget(self) -> None:
        """`zero_grad()`: a backward pass that raised is forgotten (its gradients are dropped
        next): the reductions it issued are waited for, what it gathered is released, and
        the next pass starts afresh. Local: no collective is issued."""
        if not self.state.phase.in_backward:
            return
        if self.scheduler is not None:
            self.scheduler.end_backward(completed=False)
        self.reducer.abandon_pass()
        self._reduced_in_pass.clear()
        if self._gemini is not None and not self._warmed_up:
            self._gemini.restart_warmup()
        self.state.phase = Phase.IDLE

    def wait_param_gathers(self) -> None:
        """Make every parameter whole now (see [Note: deferred parameter gathers])."""
        if self.param_gather is not None:
            self.param_gather.wait_all()

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every hook of this runtime (once; closing again does nothing)."""
        self._remove_hooks()

    @property
    def closed(self) -> bool:
        return not self._remove_hooks.alive


def release_if_idle(chunk: Chunk) -> None:
    """Stage 3: backward needs `chunk`'s parameters no more (its gradients are complete, or
    reduced): release its payload unless a module still uses it."""
    if not chunk.in_use and not chunk.keep_gathered:
        chunk.payload.release()


def _inside_backward() -> bool:
    """Whether autograd is running a backward pass on this thread now."""
    return bool(torch._C._current_graph_task_id() != -1)


__all__ = ["Runtime", "RuntimeSettings", "release_if_idle"]
