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


def test_a_small_model_is_not_packed_into_one_chunk_when_the_gathered_peak_is_bounded() -> None:
    # 40 tensors of 1,000 elements under the seeds' 16M-element minimum: least waste alone
    # packs them into one chunk (the whole model gathered at once).
    numels = [[1_000] * 40]
    kwargs = {"world_size": 2, "search_range_numel": 32 * 1024**2, "n_grids": 4096}
    seeds_minimum = 16 * 1024**2
    unbounded = search_chunk_size(numels, min_chunk_size_numel=seeds_minimum, **kwargs)  # type: ignore[arg-type]
    assert unbounded.num_chunks == 1 and unbounded.max_chunk_numel is None
    bounded = search_chunk_size(
        numels,
        min_chunk_size_numel=seeds_minimum,
        max_gathered_numel=10_000,  # a quarter of the model
        min_num_chunks=8,
        **kwargs,  # type: ignore[arg-type]
    )
    # Four gathered chunks within 10,000 elements: at most 2,500 each. 1,250 to 2,500: 2,000
    # packs with no waste (2,500 would leave 500 unused in each chunk).
    assert (bounded.chunk_size_numel, bounded.num_chunks, bounded.wasted_numel) == (2_000, 20, 0)
    assert bounded.max_chunk_numel == 2_500
    assert bounded.gathered_peak_numel == 8_000 <= 10_000
    assert "up to the bound of 2,500" in bounded.reason and "(20 chunks" in bounded.reason


def test_a_parameter_above_the_bound_gets_a_chunk_of_its_own() -> None:
    # Four chunks within 400 elements: at most 100 each. The 5,000-element tensor is never
    # split: it gets a chunk of exactly its size, the small ones share the searched size.
    result = search_chunk_size(
        [[5_000, 60, 40, 100]],
        world_size=1,
        search_range_numel=1_000,
        n_grids=100,
        min_chunk_size_numel=1,
        max_gathered_numel=400,
        min_num_chunks=2,
    )
    assert (result.chunk_size_numel, result.num_chunks, result.wasted_numel) == (100, 3, 0)
    assert result.gathered_peak_numel == 5_000 + 2 * 100
    assert "get a chunk of their own" in result.reason
    with pytest.raises(ValueError, match="min_num_chunks must be a positive int, got 0"):
        search_chunk_size(
            [[1]], world_size=1, search_range_numel=1, n_grids=1, min_chunk_size_numel=1,
            min_num_chunks=0,
        )  # fmt: skip


def test_a_default_stage_3_model_keeps_its_gathered_peak_under_the_bound() -> None:
    """No chunk_size_numel: the searched size keeps every gathered chunk of a forward and
    backward, measured at every module boundary, within DEFAULT_GATHERED_SHARE of the model."""
    from shardwise import MixedPrecision, zero_model_wrapper
    from shardwise.chunk.search import DEFAULT_GATHERED_SHARE, DEFAULT_MIN_NUM_CHUNKS
    from shardwise.planner import plan
    from shardwise.testing import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_embd=128))
    total = gpt.num_parameters()
    # The planner proposes the size the wrapper then picks, for the same reason.
    planned = plan(
        gpt, world_size=1, device_memory_bytes=10**12, host_memory_bytes=10**12,
        param_dtype=torch.float16, compute_dtype=torch.float32,
    )  # fmt: skip
    model = zero_model_wrapper(
        gpt,
        zero_stage=3,
        gemini_config={
            "device": torch.device("cpu"),
            "mixed_precision": MixedPrecision(
                param_dtype=torch.float16, compute_dtype=torch.float32
            ),
        },
    )
    chunks = model.chunk_manager.chunks
    assert planned.chunk_size_numel == model.chunk_manager.chunk_size_numel
    assert planned.chunk_size_reason == model.chunk_manager.chunk_size_reason
    assert "least waste, then fewest chunks" in planned.chunk_size_reason
    assert model.chunk_manager.chunk_size_reason in repr(model)
    assert len(chunks) >= DEFAULT_MIN_NUM_CHUNKS
    peak = 0

    def sample(*_: object) -> None:
        nonlocal peak
        gathered = sum(c.padded_numel for c in chunks if c.payload.state.value == "gathered")
        peak = max(peak, gathered)

    for module in model.module.modules():
        module.register_forward_pre_hook(sample)
        module.register_forward_hook(sample)
    for chunk_hook in (model.module.blocks[-1], model.module.lm_head, model.module.blocks[0]):
        chunk_hook.register_full_backward_hook(sample)
    idx = torch.randint(0, 512, (2, 64))
    _, loss = model(idx, idx)
    model.backward(loss)
    assert 0 < peak <= DEFAULT_GATHERED_SHARE * total, (peak, total)
