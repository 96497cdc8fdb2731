"""The working set of stage 3 (chunks gathered at once, gradient buffers) at another chunk
size, estimated from what a step held at this one.

[Note: the working set at another chunk size]
At each point of a step the device holds some chunks gathered (and, for trainable ones, their
gradient buffers): those whose tensors the running modules need, and what the schedule keeps
around them. A chunk is held for some of its tensors; with smaller chunks the same point holds
the smaller chunks of those tensors, typically one or two where one large one was (the module
running, whose tensors are packed together, and a neighbour's), and no more than the large
one held: so each chunk held at a recorded point counts, at a smaller size, as the chunk of
its largest tensor (which no size splits) and two chunks of that size, at most its own
footprint (gathered payload, its compute copy, the gradient buffer of a trainable chunk).
The largest such sum over the recorded points is the estimate. It is checked by rerunning
(tests/test_working_set_budget.py), not proved: which tensors of a held chunk a point needs is
not recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from shardwise.chunk.chunk import Chunk


def _bytes_per_element(chunk: Chunk) -> int:
    """Device bytes per element a gathered chunk takes: payload, compute copy when the compute
    dtype differs, and gradient buffer when trainable."""
    size = torch.empty((), dtype=chunk.dtypes.payload).element_size()
    if chunk.dtypes.compute != chunk.dtypes.payload:
        size += torch.empty((), dtype=chunk.dtypes.compute).element_size()
    if chunk.requires_grad:
        size += torch.empty((), dtype=chunk.dtypes.reduce).element_size()
    return size


def working_set_estimate(
    chunks: Sequence[Chunk], held: Iterable[Sequence[int]], chunk_size_numel: int
) -> int:
    """The most bytes the chunks gathered at once (with their gradient buffers) would take at
    `chunk_size_numel` (at most the current size), given the ids of the chunks of `chunks`
    held at each point of a step (see [Note: the working set at another chunk size]).

    Args:
        chunks: the chunks as packed now (all of a manager's, in id order).
        held: for each recorded point, the ids of the chunks holding a gathered payload or a
            gradient buffer there.
        chunk_size_numel: the chunk size to estimate the working set at.
    """
    if not chunks:
        return 0
    world = chunks[0].world_size
    at_size: dict[int, int] = {}
    for chunk in chunks:
        per_element = _bytes_per_element(chunk)
        largest = max((info.numel for info in chunk.tensors), default=0)
        smaller = -(-(largest + 2 * chunk_size_numel) // world) * world
        at_size[chunk.chunk_id] = min(chunk.padded_numel, smaller) * per_element
    return max((sum(at_size[i] for i in ids) for ids in held), default=0)


def largest_fitting_chunk_size(
    chunks: Sequence[Chunk], held: Sequence[Sequence[int]], budget_bytes: int, below: int
) -> tuple[int, int] | None:
    """The largest chunk size among `below` halved again and again (down to 1, every tensor
    a chunk of its own) whose estimated working set (`working_set_estimate`) fits
    `budget_bytes`, with that estimate; None when even the smallest does not fit."""
    size = below // 2
    while size >= 1:
        estimate = working_set_estimate(chunks, held, size)
        if estimate <= budget_bytes:
            return size, estimate
        size //= 2
    return None
