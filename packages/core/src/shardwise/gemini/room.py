"""The memory manager's answer when asked to make room on the device.

[Note: room after the reductions]
Under "auto" the gradient reductions still in flight hold gathered chunks and gradient buffers
on the device, and finishing them is sometimes the cheapest way to make room (see [Note: auto
placement] in auto_placement.py). The reductions belong to the runtime, above the manager, and
the runtime is what asks for room (before a gather, after a gradient arrives), so the manager
does not reach back up to finish them: it answers `Room.AFTER_REDUCTIONS`, the caller finishes
the reductions in flight and calls `GeminiManager.resume()`, which completes the decision it
paused (evicting what is still needed, or raising where nothing is left to move).
"""

from __future__ import annotations

from enum import Enum


class Room(Enum):
    """What a request for device room came to."""

    MADE = "made"
    """Done: the allocation fits, or everything that could move has moved (a budget check
    that still finds the device over its budget has raised)."""
    AFTER_REDUCTIONS = "after_reductions"
    """Finishing the gradient reductions in flight makes the room: the caller finishes them,
    then calls `resume()` on the manager, which finishes what it was deciding."""
