"""Choice of a chunk size: within a bound on the gathered peak, the one that wastes least
memory, and among near ties, needs the fewest collectives.

A chunk is sized for `chunk_size` elements (rounded up to a multiple of the world size, so its
shards are equal): whatever the parameters packed into it in order leave unused is waste, as is
the space a gathered chunk reserves. Candidates run from the largest parameter (or the minimum
size, if larger) over `search_range` in `n_grids` steps; each is scored by packing the
parameters exactly as ChunkManager does. All candidates are packed together, one vectorised
step per chunk, so a model of ten thousand tensors is searched in well under a second.

[Note: the gathered peak bounds the chunk size]
Stage 3 holds a chunk whole from its gather to its release; with prefetch the next one too, and
at the turn from forward to backward the chunk kept gathered for backward beside them (and a
chunk of tied embeddings, used at both ends): up to four gathered chunks are its peak beyond the
shards (`GATHERED_AT_ONCE`). Least waste alone favours one chunk for any model smaller than the
minimum size (nothing is left over when everything fits), which gathers the whole model at once
(no memory saved at the peak) and leaves nothing to overlap. So a caller may bound the sizes
searched: `max_gathered_numel` caps those chunks together, `min_num_chunks` keeps the model in
at least that many chunks. A tensor is never split: one larger than the searched size gets a
chunk of its own, exactly its size, as ChunkManager packs it. So the bounded search runs from
half the bound (or from the largest parameter, if that is smaller) up to the bound, a minimum
size above the bound yields to it, and the peak is the largest parameter's chunk beside the
others at the searched size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Chunks stage 3 may hold gathered at once: the one computing, the one prefetched, the one kept
# gathered from the end of forward for backward, and with tied embeddings the chunk holding
# them, used at both ends of the pass (measured at every module boundary of the toy GPT: 3
# untied, 4 tied).
GATHERED_AT_ONCE = 4

# The seeds' defaults, in bytes: search 64 MiB above a 32 MiB minimum, in 4096 steps.
DEFAULT_SEARCH_RANGE_BYTES = 64 * 1024**2
DEFAULT_MIN_CHUNK_BYTES = 32 * 1024**2
DEFAULT_SEARCH_N_GRIDS = 4096
# Bounds on the searched size (see [Note: the gathered peak bounds the chunk size]): the chunks
# gathered at once hold at most this share of the parameters, and of a device budget when one
# is given; and the model spans at least this many chunks, so gathers can run ahead of compute.
# Billion-parameter models keep the seeds' sizes (the bounds are far above them); a model
# smaller than the seeds' minimum chunk no longer lands in one chunk. Half of the parameters
# with 4 chunks kept one chunk's step time on the suite's GPT; a quarter with 8 cost 10% more
# there (benchmarks/RESULTS.md, chunk-search block).
DEFAULT_GATHERED_SHARE = 0.5
DEFAULT_BUDGET_GATHERED_SHARE = 0.25
DEFAULT_MIN_NUM_CHUNKS = 4


@dataclass(frozen=True, slots=True)
class ChunkSearchResult:
    """The chosen size and how it packs."""

    chunk_size_numel: int
    num_chunks: int
    wasted_numel: int
    largest_numel: int = 0
    """The largest parameter (a chunk of its own when above `chunk_size_numel`)."""
    max_chunk_numel: int | None = None
    """The largest size searched (None: unbounded), see [Note: the gathered peak ...]."""
    reason: str = ""
    """One line: what was chosen and why, for logs and summaries."""

    @property
    def gathered_peak_numel(self) -> int:
        """Elements the chunks gathered at once hold at most (see GATHERED_AT_ONCE): the
        largest parameter's chunk and the others at the searched size."""
        others = min(self.num_chunks, GATHERED_AT_ONCE) - 1
        return max(self.chunk_size_numel, self.largest_numel) + others * self.chunk_size_numel


def search_chunk_size(
    groups: Sequence[Sequence[int]],
    *,
    world_size: int,
    search_range_numel: int,
    n_grids: int,
    min_chunk_size_numel: int,
    hidden_dim: int | None = None,
    tie_tolerance: float = 0.01,
    max_gathered_numel: int | None = None,
    min_num_chunks: int = 1,
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
        max_gathered_numel: when set, sizes above a quarter of it are not searched, so the
            chunks gathered at once (GATHERED_AT_ONCE) hold at most this many elements (see
            [Note: the gathered peak bounds the chunk size]).
        min_num_chunks: sizes above the total parameter count divided by this are not
            searched (1: no such bound).
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
    for name, bound in (
        ("max_gathered_numel", max_gathered_numel),
        ("min_num_chunks", min_num_chunks),
    ):
        if bound is not None and (
            isinstance(bound, bool) or not isinstance(bound, int) or bound < 1
        ):
            raise ValueError(f"{name} must be a positive int, got {bound!r}")
    largest = max(max(group) for group in sizes)
    total = sum(sum(group) for group in sizes)
    cap: int | None = None
    if max_gathered_numel is not None:
        cap = max_gathered_numel // GATHERED_AT_ONCE
    if min_num_chunks > 1:
        cap = min(cap if cap is not None else total, -(-total // min_num_chunks))
    start = max(largest, min_chunk_size_numel)
    end = start + search_range_numel
    if cap is not None and end > cap:
        # From half the bound up (or from the largest parameter, if smaller) to the bound; a
        # parameter above a size gets a chunk of its own (see the Note).
        start = min(start, max(cap - search_range_numel, min(largest, cap // 2), 1))
        end = cap
    step = max(1, (end - start) // n_grids)
    candidates = torch.arange(start, end + 1, step, dtype=torch.int64)
    if hidden_dim is not None:
        candidates = (candidates + hidden_dim - 1) // hidden_dim * hidden_dim
    candidates = (candidates + world_size - 1) // world_size * world_size
    candidates = torch.unique(candidates)  # sorted ascending
    if cap is not None:
        # Rounding up may pass the bound: keep what rounding allows, and at least the smallest.
        candidates = candidates[(candidates <= cap) | (candidates == candidates[0])]
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
    size, count, wasted = int(candidates[choice]), int(counts[choice]), int(waste[choice])
    reason = (
        f"chunk_size_numel {size:,} ({count} chunks, {wasted:,} elements wasted): least waste, "
        f"then fewest chunks, among {len(candidates)} sizes from {int(candidates[0]):,}"
    )
    if cap is None:
        reason += f" to {int(candidates[-1]):,}"
    else:
        reason += (
            f" up to the bound of {cap:,}: {GATHERED_AT_ONCE} gathered chunks within "
            f"{max_gathered_numel or GATHERED_AT_ONCE * cap:,} of the "
            f"{total:,} elements and at least {min_num_chunks} chunks"
        )
    if largest > size:
        reason += f"; parameters above it (the largest: {largest:,}) get a chunk of their own"
    return ChunkSearchResult(size, count, wasted, largest, cap, reason)


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
        # The chunk starting at `position` takes every next parameter that still fits; a
        # parameter larger than the capacity gets a chunk of its own, exactly its size (as
        # ChunkManager opens one of max(chunk size, numel)).
        end = torch.searchsorted(prefix, base + capacities, right=True) - 1
        alone = active & (end == position)
        end = torch.where(alone, position + 1, end)
        end = torch.where(active, end, position)
        used = prefix[end] - base
        waste += torch.where(active & ~alone, capacities - used, 0)
        count += active.long()
        position = end
        active = position < total
    return waste, count


def default_chunk_search(
    groups: Sequence[Sequence[int]],
    *,
    world_size: int,
    param_element_size: int,
    gathered_element_size: int,
    device_budget_bytes: int | None = None,
    search_range_bytes: int = DEFAULT_SEARCH_RANGE_BYTES,
    min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
    n_grids: int = DEFAULT_SEARCH_N_GRIDS,
    hidden_dim: int | None = None,
) -> ChunkSearchResult:
    """The chunk size stage 3 gets when none is set (the wrappers and the planner both ask
    here): the seeds' knobs, in bytes of the parameter dtype, bounded so that the chunks
    gathered at once hold at most DEFAULT_GATHERED_SHARE of the parameters (and
    DEFAULT_BUDGET_GATHERED_SHARE of `device_budget_bytes`, when given) and the model spans at
    least DEFAULT_MIN_NUM_CHUNKS chunks.

    Args:
        groups: element counts of the parameters packed together, in order (trainable and
            frozen apart, as ChunkManager packs them).
        world_size: the ranks a chunk is sharded over.
        param_element_size: bytes of the stored parameter dtype.
        gathered_element_size: bytes a gather allocates per element (payload, and its compute
            copy when the compute dtype differs).
    """
    max_gathered = max(1, int(sum(map(sum, groups)) * DEFAULT_GATHERED_SHARE))
    if device_budget_bytes is not None and device_budget_bytes > 0:
        by_budget = (
            int(device_budget_bytes * DEFAULT_BUDGET_GATHERED_SHARE) // gathered_element_size
        )
        max_gathered = max(1, min(max_gathered, by_budget))
    return search_chunk_size(
        groups,
        world_size=world_size,
        search_range_numel=search_range_bytes // param_element_size,
        n_grids=n_grids,
        min_chunk_size_numel=max(1, min_chunk_bytes // param_element_size),
        hidden_dim=hidden_dim,
        max_gathered_numel=max_gathered,
        min_num_chunks=DEFAULT_MIN_NUM_CHUNKS,
    )
