"""What the memory manager needs from the layers above it, as interfaces they implement.

The manager moves chunks' optimizer sides and counts device memory; one thing it cannot see
lives above it: the gradient reductions still in flight (each holds a gathered chunk and its
gradient buffer on the device). `GradReducer` implements `ReductionsInFlight`; the manager
passes itself with each call that may need room (`GeminiManager.before_gather`, `check_budget`,
...), and the manager never imports the runtime. (The optimizer's state of each chunk is
the chunk's own: see [Note: the chunk owns its optimizer state] in chunk/optimizer_state.py.)
"""

from __future__ import annotations

from typing import Protocol

from shardwise.chunk import Chunk


class ReductionsInFlight(Protocol):
    """The gradient reductions started but not yet waited for."""

    def in_flight_bytes(self) -> int:
        """Device bytes the reductions in flight hold."""
        ...

    def retiring_bytes(self, chunks: list[Chunk]) -> int:
        """Device bytes the next reduction's start frees, when it is one of `chunks`'."""
        ...


class NoReductions:
    """A model that reduces nothing in the background."""

    def in_flight_bytes(self) -> int:
        return 0

    def retiring_bytes(self, chunks: list[Chunk]) -> int:
        return 0


# What a call made outside a model's passes (a test, the placement at wrap) weighs.
NO_REDUCTIONS = NoReductions()
