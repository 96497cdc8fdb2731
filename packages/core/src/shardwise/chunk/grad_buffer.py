"""A chunk's gradient buffer, filled without zeroing it first.

[Note: gradient buffers start uninitialised]
A chunk's gradient buffer is allocated empty when its first gradient of a backward arrives;
each tensor's first gradient is copied in and later ones are added. Zeroing the whole buffer
first and adding every gradient costs a write pass over the chunk and, on a CPU, 2.5 times the
time (8 MiB: 2.0 ms against 0.8 ms). What no gradient reached (padding, an unused branch, a
frozen tensor) is zeroed before the buffer is reduced or kept for the next pass.
"""

from __future__ import annotations

import torch

from shardwise.chunk.states import TensorInfo


def zero_unwritten(buffer: torch.Tensor, tensors: list[TensorInfo], written: set[int]) -> None:
    """Zero every element of `buffer` outside the tensors whose indices are in `written`."""
    covered = sorted((tensors[i].offset, tensors[i].offset + tensors[i].numel) for i in written)
    position = 0
    for begin, end in covered:
        if begin > position:
            buffer[position:begin].zero_()
        position = max(position, end)
    if position < buffer.numel():
        buffer[position:].zero_()
