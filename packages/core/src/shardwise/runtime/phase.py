"""Where a wrapped model is in its passes: one phase, set by the `Runtime` alone.

[Note: the phase of the pass]
The parts that run a model's passes (the stage-3 gather schedule, the gradient reducer, the
memory manager) each used to keep a flag of their own for where the pass stood (which pass the
gathers serve, whether the end of backward was queued), set from whichever hook saw a change
first. When a backward pass raised (a user's hook, an out-of-memory error the loop catches to
skip the batch) autograd never ran the end of backward, so those flags stayed where the
exception left them: the next passes ran with a callback that was never queued again, a pass
that still "served backward" and reductions half issued, and the results drifted from a plain
torch loop without any error. Now the `Runtime` (runtime/runtime.py) owns one `Phase`, which
the parts read, and moves it through each pass; a pass it finds still in a backward phase when
no backward is running (the next forward, `zero_grad()`, the optimizer step) was left by an
exception, and the runtime settles it first (see `Runtime.settle`), as FSDP2 resets its
per-iteration state.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    """The phase of a wrapped model's pass (FSDP2's `TrainingState`)."""

    IDLE = "idle"
    """No pass runs: nothing is queued on autograd and no gradient is in flight. At stage 3
    the chunks a backward starts with may stay gathered after a forward with gradients."""
    FORWARD = "forward"
    """The model's forward runs: gathers serve forward, and the first one records its order."""
    PRE_BACKWARD = "pre-backward"
    """A backward pass runs: the first of the engine's hooks it reached queued the end of
    backward on autograd; gathers serve backward (with their gradient buffers), gradients are
    copied into chunks and reduced as chunks complete. A forward re-run by activation
    checkpointing happens in this phase."""
    POST_BACKWARD = "post-backward"
    """Autograd finished the backward pass and its end runs: the remaining reductions, the
    releases, `.grad`. Back to `IDLE` once done."""

    @property
    def in_backward(self) -> bool:
        return self in (Phase.PRE_BACKWARD, Phase.POST_BACKWARD)


class PassState:
    """The phase of the pass now: written by the `Runtime` only, read by the parts it gives
    this object to when it builds them."""

    __slots__ = ("phase",)

    def __init__(self) -> None:
        self.phase = Phase.IDLE


__all__ = ["PassState", "Phase"]
