"""The parts that run a wrapped model's passes, owned together with their hooks.

A `Runtime` is built in one ordered function (`engine.build.build_runtime`): the gather
schedule (stage 3), the deferred parameter gathers (stages 1 and 2), the gradient reducer and
the one end of backward that runs the schedule's and the reducer's steps in order (see [Note:
one end of backward] in runtime/backward_end.py). It owns every hook those parts put on the
user's module and tensors (see [Note: one owner of an engine's hooks] in runtime/hooks.py) and
removes them when closed, or when it is collected: the hooks torch keeps in C++ hold the
engine only weakly (see [Note: hooks hold the engine weakly] in runtime/grad_reducer.py), so a
dropped model is collected, and a tensor the user kept (a parameter in a list, an EMA copy's
source) carries no dead hook of it afterwards. The runtime starts no thread: the disk tier's
threads belong to its pool (chunk/disk_pool.py) and telemetry's to its emitter, each stopped
when its owner is collected.
"""

from __future__ import annotations

import weakref

from shardwise.runtime.backward_end import BackwardEnd
from shardwise.runtime.gather_scheduler import GatherScheduler
from shardwise.runtime.grad_reducer import GradReducer
from shardwise.runtime.hooks import HookSet
from shardwise.runtime.param_gather import DeferredParamGather


class Runtime:
    """A wrapped model's gather schedule, deferred gathers, gradient reducer and end of
    backward, with the hooks they installed (`hooks`)."""

    def __init__(
        self,
        *,
        hooks: HookSet,
        reducer: GradReducer,
        scheduler: GatherScheduler | None,
        param_gather: DeferredParamGather | None,
        backward_end: BackwardEnd,
    ) -> None:
        self.hooks = hooks
        self.reducer = reducer
        self.scheduler = scheduler
        self.param_gather = param_gather
        self.backward_end = backward_end
        # The finalizer holds the hook set alone (handles, which hold no part of the engine),
        # so it keeps nothing alive and runs once: at close() or at collection.
        self._remove_hooks = weakref.finalize(self, hooks.remove)

    def close(self) -> None:
        """Remove every hook of this runtime (once; closing again does nothing)."""
        self._remove_hooks()

    @property
    def closed(self) -> bool:
        return not self._remove_hooks.alive


__all__ = ["Runtime"]
