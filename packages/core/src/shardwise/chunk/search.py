"""Choice of a chunk size: the one that wastes least memory, and among near ties, needs the
fewest collectives.

A chunk is sized for `chunk_size` elements (rounded up to a multiple of the world size, so its
shards are equal): whatever the parameters packed into it in order leave unused is waste, as is
the space a gathered chunk reserves. Candidates run from the largest parameter (or the minimum
size, if larger) over `search_range` in `n_grids` steps; each is scored by packing the
parameters exactly as ChunkManager does. All candidates are packed together, one vectorised
step per chunk, so a model of ten thousand tensors is searched in well under a second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ChunkSearchResult:
    """The chosen size and how it packs."""

    chunk_size_numel: int
    num_chunks: int
    wasted_numel: int


def search_chunk_size(
    groups: Sequence[Sequence[int]],
    *,
    world_size: int,
    search_range_numel: int,
    n_grids: int,
    min_chunk_size_numel: int,
    hidden_dim: int | None = None,
    tie_tolerance: float = 0.01,
) -> ChunkSearchResult:
    """Pick a chunk size for parameters packed in order, each group into chunks of its own.

    Args:
        groups: element counts of the parameters, per packing group (trainable, frozen).
        world_size: ranks the chunks are sharded over.
        search_range_numel: how far above the smallest candidate to search, in elements.
        n_grids: intervals in the search range.
        min_chunk_size_numel: the smallest candidate, in elements.
        hidden_dim: round candidates up to a multiple of this (the model's width).
        tie_tolerance: candidates within this fraction of the least waste count as ties.
    """
    for name, value in (
        ("world_size", world_size),
        ("n_grids", n_grids),
        ("min_chunk_size_numel", min_chunk_size_numel),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if (
        isinstance(search_range_numel, bool)
        or not isinstance(search_range_numel, int)
        or search_range_numel < 0
    ):
        raise ValueError(f"search_range_numel must be an int >= 0, got {search_range_numel!r}")
    sizes = [list(group) for group in groups if len(group)]
    if not sizes:
        raise ValueError("no parameters to pack")
    largest = max(max(group) for group in sizes)
    start = max(largest, min_chunk_size_numel)
    step = max(1, search_range_numel // n_grids)
    candidates = torch.arange(start, start + search_range_numel + 1, step, dtype=torch.int64)
    if hidden_dim is not None:
        candidates = (candidates + hidden_dim - 1) // hidden_dim * hidden_dim
    candidates = (candidates + world_size - 1) // world_size * world_size
    candidates = torch.unique(candidates)  # sorted ascending
    waste = torch.zeros_like(candidates)
    counts = torch.zeros_like(candidates)
    for group in sizes:
        group_waste, group_count = _pack(torch.tensor(group, dtype=torch.int64), candidates)
        waste += group_waste
        counts += group_count
    least = int(waste.min())
    near = waste <= least + max(1, int(least * tie_tolerance))
    fewest = int(counts[near].min())
    choice = int(torch.nonzero(near & (counts == fewest))[0])
    return ChunkSearchResult(int(candidates[choice]), int(counts[choice]), int(waste[choice]))


def _pack(numels: torch.Tensor, capacities: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy in-order packing for every capacity at once: (waste, chunk count) per capacity."""
    prefix = torch.cat([torch.zeros(1, dtype=torch.int64), numels.cumsum(0)])
    total = len(numels)
    position = torch.zeros_like(capacities)
    waste = torch.zeros_like(capacities)
    count = torch.zeros_like(capacities)
    active = position < total
    while bool(active.any()):
        base = prefix[position]
        # The chunk starting at `position` takes every next parameter that still fits.
        end = torch.searchsorted(prefix, base + capacities, right=True) - 1
        end = torch.where(active, end, position)
        used = prefix[end] - base
        waste += torch.where(active, capacities - used, 0)
        count += active.long()
        position = end
        active = position < total
    return waste, count
