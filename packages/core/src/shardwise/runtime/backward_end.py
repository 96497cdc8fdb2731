"""The end of a backward pass, as one callback that runs the engine's steps in a fixed order.

[Note: one end of backward]
Gradient routing (GradReducer) and the stage-3 gather schedule (GatherScheduler) each have work
once autograd has finished a backward pass: reduce what is left, release the chunks still
gathered. Each used to queue its own autograd callback when it first saw the pass, so their
order was whichever noticed the pass first: the schedule's hook on the forward's output
usually, the reducer's first gradient hook where an output has no hook of the schedule's. Now
one callback ends the pass: the first of the parts' hooks a backward reaches calls the
runtime's `enter_backward` (runtime/runtime.py), which moves the pass's phase and queues the
runtime's end of backward, running the steps in a fixed order: the schedule's first (chunks
are released and the gather order settles), then after the first pass the memory manager's
plan, then the reducer's (the remaining reductions, `.grad`). A reducer used alone (ColoDDP's)
queues its own end through `BackwardEnd`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class BackwardEnd:
    """Runs `steps`, in order, once at the end of each backward pass that queued it."""

    def __init__(self, steps: Sequence[Callable[[], None]] = ()) -> None:
        self.steps = list(steps)
        self._queued = False

    def queue(self) -> None:
        """Called from inside a backward pass: run the steps when autograd finishes it
        (once, however many times this pass calls it)."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def settle(self) -> None:
        """Outside a backward pass: a pass that raised before autograd ended it never ran
        the steps; run them now, as autograd would have (see [Note: the phase of the pass] in
        runtime/phase.py, whose `Runtime` does the same for a wrapped model)."""
        if self._queued and torch._C._current_graph_task_id() == -1:
            self._run()

    def _run(self) -> None:
        self._queued = False
        for step in self.steps:
            step()
