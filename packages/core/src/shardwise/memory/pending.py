"""Work started now and finished later: one protocol for every such object of the engine.

A gather started ahead, a publish of updated parameters, a gradient reduction, a disk read and
a copy between devices each hold buffers until their work completes, and each is finished by
`wait()`, which makes the results usable where they are needed (the host, or the current
stream) and returns them. Each owns what it holds: dropping the object before `wait()` is
allowed only where the owner says so (a copy's buffers stay alive through its event, see
[Note: streams and events] in memory/streams.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch

T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")


class Pending(Protocol[T_co]):
    """Work started, whose result `wait()` returns once it is usable."""

    def wait(self) -> T_co: ...


class Done(Generic[T]):
    """Work that finished when it started (no streams, or nothing to do)."""

    __slots__ = ("_value",)

    def __init__(self, value: T) -> None:
        self._value = value

    def wait(self) -> T:
        return self._value


class PendingCopy:
    """A copy between devices in flight: `tensor` holds the values once `wait()` returned.

    Args:
        tensor: the destination.
        event: the copy's completion, recorded on the stream that ran it (None: done).
        keep: the buffers the copy reads or writes, held until `wait()`.
    """

    __slots__ = ("_event", "_keep", "tensor")

    def __init__(
        self, tensor: torch.Tensor, event: Any = None, keep: Sequence[torch.Tensor] = ()
    ) -> None:
        self.tensor = tensor
        self._event = event
        self._keep = tuple(keep)

    @property
    def done(self) -> bool:
        """Whether the copy has completed (without waiting)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> torch.Tensor:
        """The destination, usable here: on the host once the copy completed (the host
        waits), on a device once the current stream waits for the copy (the host does not)."""
        event, self._event = self._event, None
        if event is not None:
            if self.tensor.device.type == "cpu":
                event.synchronize()
            else:
                torch.cuda.current_stream(self.tensor.device).wait_event(event)
        self._keep = ()
        return self.tensor


__all__ = ["Done", "Pending", "PendingCopy"]
