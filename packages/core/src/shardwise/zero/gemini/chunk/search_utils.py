"""`search_chunk_configuration`: ColossalAI's chunk-size search, by its definition, for scripts
that call it and pass its result to `GeminiDDP(chunk_config_dict=...)`. (Without a chunk
configuration the engine searches its own way, bounding the chunks gathered at once: see
chunk/search.py.)

ColossalAI's definition: the parameters not ignored, in `model.parameters()` order (a tied
tensor once), packed greedily in order; a group whose total is below `min_chunk_size_m` gets
one chunk of exactly that total, kept gathered; otherwise, leaving out the parameters larger
than their sizes' mean plus three standard deviations (`filter_exlarge_params`), the candidates
run from the largest remaining parameter (or `min_chunk_size_m`, if larger), rounded up to a
multiple of `search_interval`, over `search_range_m` in steps of `search_interval`, and the
first with the least unused space wins, rounded up to a multiple of the group size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwise import comm
from shardwise.prepare.ignore import is_ignored


def search_chunk_configuration(
    model: nn.Module,
    search_range_m: float,
    search_interval: int,
    min_chunk_size_m: float = 32,
    filter_exlarge_params: bool = True,
    strict_ddp_flag: bool = False,
    process_group: ProcessGroup | None = None,
    memstas: Any = None,
) -> tuple[dict[int, dict[str, Any]], int, int]:
    """The chunk configuration ColossalAI's search gives `model`: `({group size: {"chunk_size":
    n, "keep_gathered": b}}, total parameter elements, unused elements at that size)`.

    Args:
        model: the module whose parameters are packed.
        search_range_m: how far above the smallest candidate to search, in 2**20 elements.
        search_interval: the step between candidates, in elements (a layer's width).
        min_chunk_size_m: the smallest chunk, in 2**20 elements.
        filter_exlarge_params: leave out of the search the parameters above mean + 3 standard
            deviations of the sizes.
        strict_ddp_flag: accepted; ColossalAI 0.5's search does not read it either (replicate
            with GeminiDDP's `strict_ddp_mode`).
        process_group: the group chunks are sharded over (None: the default group).
        memstas: refused unless None (ColossalAI orders by a memory trace with it).
    """
    if memstas is not None:
        raise ValueError(
            "memstas cannot be honoured: the search packs in model.parameters() order; leave "
            "it None"
        )
    if isinstance(search_interval, bool) or not isinstance(search_interval, int):
        raise TypeError(f"search_interval must be an int, got {search_interval!r}")
    if search_interval < 1:
        raise ValueError(f"search_interval must be >= 1, got {search_interval}")
    search_range = round(search_range_m * 1024**2)
    if search_range < 0:
        raise ValueError(f"search_range_m must be >= 0, got {search_range_m}")
    min_chunk_size = round(min_chunk_size_m * 1024**2)
    group_size = comm.world_size(process_group)
    sizes = [p.numel() for p in model.parameters() if not is_ignored(p)]
    total = sum(sizes)
    if total < min_chunk_size:
        return {group_size: {"chunk_size": total, "keep_gathered": True}}, total, 0
    if filter_exlarge_params and sizes:
        limit = _mean_plus_three_std(sizes)
        sizes = [s for s in sizes if s <= limit]
    start = -(-max([min_chunk_size, *sizes]) // search_interval) * search_interval
    best_size, least = start, math.inf
    for size in range(start, start + search_range + 1, search_interval):
        unused = _unused(sizes, size)
        if unused < least:
            best_size, least = size, unused
    best_size += -best_size % group_size  # equal shards
    return {group_size: {"chunk_size": best_size, "keep_gathered": False}}, total, int(least)


def _mean_plus_three_std(sizes: list[int]) -> float:
    values = torch.tensor(sizes, dtype=torch.float64)
    return float(values.mean() + 3 * values.std(unbiased=False))


def _unused(sizes: list[int], chunk_size: int) -> int:
    """Elements left empty packing `sizes` in order into chunks of `chunk_size` (each size at
    most `chunk_size`), the last chunk's remainder included."""
    unused, left = 0, 0
    for size in sizes:
        if size > left:
            unused += left
            left = chunk_size
        left -= size
    return unused + left
