"""What the memory manager needs from the layers above it, as interfaces they implement.

The manager moves chunks' optimizer sides and counts device memory; two things it cannot see
live above it: the optimizer's state of each chunk (and the views the optimizer steps, which a
move replaces), and the gradient reductions still in flight (each holds a gathered chunk and
its gradient buffer on the device). `ZeroOptimizer` implements `OptimizerSide` and
`GradReducer` implements `ReductionsInFlight`; the manager asks them through these, and never
imports the engine.
"""

from __future__ import annotations

from typing import Protocol

from shardwise.chunk import Chunk


class OptimizerSide(Protocol):
    """The optimizer stepping the chunks' fp32 masters."""

    def chunk_state_bytes(self, chunk: Chunk) -> int:
        """Bytes of optimizer state (moments, ...) kept for `chunk`, in its optim pool."""
        ...

    def rebind_chunk(self, chunk: Chunk) -> None:
        """Re-point the optimizer at `chunk`, whose optimizer side just moved pools."""
        ...


class ReductionsInFlight(Protocol):
    """The gradient reductions started but not yet waited for."""

    def finish_in_flight(self) -> None:
        """Wait for every reduction in flight, freeing what each holds."""
        ...

    def in_flight_bytes(self) -> int:
        """Device bytes the reductions in flight hold."""
        ...

    def retiring_bytes(self, chunks: list[Chunk]) -> int:
        """Device bytes the next reduction's start frees, when it is one of `chunks`'."""
        ...


class NoOptimizer:
    """Before an optimizer is attached: no state, nothing to re-point."""

    def chunk_state_bytes(self, chunk: Chunk) -> int:
        return 0

    def rebind_chunk(self, chunk: Chunk) -> None:
        pass


class NoReductions:
    """A model that reduces nothing in the background."""

    def finish_in_flight(self) -> None:
        pass

    def in_flight_bytes(self) -> int:
        return 0

    def retiring_bytes(self, chunks: list[Chunk]) -> int:
        return 0
