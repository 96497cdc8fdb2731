"""Which pass of a training step a gather serves."""

from __future__ import annotations

from enum import Enum


class Pass(Enum):
    """The pass a chunk is gathered for: in backward its gradient buffer arrives with it, so
    the room made for it counts that buffer too."""

    FORWARD = "forward"
    BACKWARD = "backward"
