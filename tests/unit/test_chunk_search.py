"""Chunk-size search: least waste, fewest chunks among near ties, deterministic and fast."""

from __future__ import annotations

import time

import pytest
import torch

from shardwise.chunk.search import search_chunk_size


def test_exact_fit_wins() -> None:
    # 10 + 10 + 10 + 5 = 35 fits one chunk of 35 with nothing wasted.
    result = search_chunk_size(
        [[10, 10, 10, 5]], world_size=1, search_range_numel=30, n_grids=30, min_chunk_size_numel=1
    )
    assert (result.chunk_size_numel, result.num_chunks, result.wasted_numel) == (35, 1, 0)


def test_waste_counts_unfilled_capacity_and_world_padding() -> None:
    # Size 20 (a multiple of 4 ranks) packs [10, 10] [10, 5]: 5 elements left in the last chunk.
    result = search_chunk_size(
        [[10, 10, 10, 5]], world_size=4, search_range_numel=0, n_grids=1, min_chunk_size_numel=20
    )
    assert (result.chunk_size_numel, result.num_chunks, result.wasted_numel) == (20, 2, 5)


def test_groups_pack_separately_and_hidden_dim_aligns() -> None:
    result = search_chunk_size(
        [[64, 64], [32]],
        world_size=2,
        search_range_numel=256,
        n_grids=64,
        min_chunk_size_numel=1,
        hidden_dim=32,
    )
    # 64 packs [64] [64] | [32]: 32 unused; 128 packs [64, 64] | [32]: 96 unused.
    assert (result.chunk_size_numel, result.num_chunks, result.wasted_numel) == (64, 3, 32)


def test_ten_thousand_tensors_in_under_a_second_and_deterministic() -> None:
    generator = torch.Generator().manual_seed(0)
    numels = torch.randint(1, 200_000, (10_000,), generator=generator).tolist()
    kwargs = {
        "world_size": 2,
        "search_range_numel": 32 * 1024**2,
        "n_grids": 4096,
        "min_chunk_size_numel": 16 * 1024**2,
    }
    start = time.perf_counter()
    first = search_chunk_size([numels], **kwargs)  # type: ignore[arg-type]
    assert time.perf_counter() - start < 1.0
    assert search_chunk_size([numels], **kwargs) == first  # type: ignore[arg-type]
    assert first.chunk_size_numel >= 16 * 1024**2


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n_grids must be a positive int, got 0"):
        search_chunk_size(
            [[1]], world_size=1, search_range_numel=1, n_grids=0, min_chunk_size_numel=1
        )
    with pytest.raises(ValueError, match="no parameters"):
        search_chunk_size(
            [[]], world_size=1, search_range_numel=1, n_grids=1, min_chunk_size_numel=1
        )
