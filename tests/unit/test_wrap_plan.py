"""Where "auto" places chunks when the model is wrapped (see [Note: auto places from the wrap]
in gemini/wrap_plan.py), on one process: shards first, in chunk order, then optimizer sides
beside shards on the device, within the budget less the working set and the share kept for
activations; the rest in host memory; the margin ratio bounds the sides."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise import ChunkManager, GeminiManager
from shardwise.chunk import Pool
from shardwise.chunk.accounting import gathered_bytes
from shardwise.gemini import placement_policy
from shardwise.gemini.wrap_plan import WRAP_ACTIVATION_SHARE, wrap_side_bytes

CPU = torch.device("cpu")


def _wrapped(
    budget: int, margin: float | None = None, activations: int | None = None
) -> ChunkManager:
    """Six trainable chunks of one Linear(8, 8) each, then a frozen one."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(7)))
    model[6].requires_grad_(False)
    manager = ChunkManager(chunk_size_numel=72, device=CPU, keep_gathered=False)
    policy = placement_policy(
        "auto", gpu_margin_mem_ratio=margin, activation_memory_bytes=activations
    )
    gemini = GeminiManager(policy, manager, device_budget_bytes=budget)
    manager.register(model.named_parameters())
    gemini.place_chunks()
    return manager


def _room(manager: ChunkManager, budget: int) -> int:
    chunks = manager.chunks
    working = 2 * max(gathered_bytes(c) for c in chunks) + max(
        c.padded_numel * 4 for c in chunks if c.requires_grad
    )
    return budget - int(WRAP_ACTIVATION_SHARE * budget) - working


def _pools(manager: ChunkManager) -> tuple[str, str]:
    def letters(pools: list[Pool | None]) -> str:
        return "".join("-" if p is None else p.value[0] for p in pools)

    chunks = manager.chunks
    return (
        letters([c.placement.payload for c in chunks]),
        letters([c.placement.optim if c.requires_grad else None for c in chunks]),
    )


def test_with_room_for_the_whole_state_everything_starts_on_the_device() -> None:
    assert _pools(_wrapped(10**7)) == ("ddddddd", "dddddd-")


def test_shards_come_first_then_sides_beside_them_in_chunk_order() -> None:
    probe = _wrapped(10**7)
    shard = probe.chunks[0].shard_numel * 4  # fp32 payloads
    side = wrap_side_bytes(probe.chunks[0])
    # Room for every shard and two sides, whatever the working set takes.
    budget = 10_000
    while _room(probe, budget) < 7 * shard + 2 * side:
        budget += 100
    while _room(probe, budget) >= 7 * shard + 3 * side:
        budget -= 10
    assert _pools(_wrapped(budget)) == ("ddddddd", "ddhhhh-")
    # Room for three shards only: no side on the device (a side beside a host shard saves no
    # copy), the rest in host memory.
    budget = 10_000
    while _room(probe, budget) < 3 * shard:
        budget += 100
    while _room(probe, budget) >= 4 * shard:
        budget -= 10
    assert _pools(_wrapped(budget)) == ("dddhhhh", "hhhhhh-")


def test_the_margin_ratio_bounds_the_sides() -> None:
    assert _pools(_wrapped(10**7, margin=0.0)) == ("ddddddd", "hhhhhh-")


def test_an_activation_estimate_replaces_the_share_kept_for_activations() -> None:
    probe = _wrapped(10**7)
    shard = probe.chunks[0].shard_numel * 4
    side = wrap_side_bytes(probe.chunks[0])
    budget = 10_000
    while _room(probe, budget) < 7 * shard:
        budget += 100
    while _room(probe, budget) >= 7 * shard + side:
        budget -= 10
    # The share kept room for the shards alone; an estimate of few activations frees the rest
    # for sides, one of the whole budget leaves no room at all.
    assert _pools(_wrapped(budget))[1] == "hhhhhh-"
    assert _pools(_wrapped(budget, activations=0))[1] != "hhhhhh-"
    assert _pools(_wrapped(budget, activations=budget)) == ("hhhhhhh", "hhhhhh-")


def test_an_activation_estimate_is_refused_where_nothing_plans_with_it() -> None:
    with pytest.raises(ValueError, match="applies only to placement_policy='auto'"):
        placement_policy("cpu", activation_memory_bytes=2**30)
    with pytest.raises(ValueError, match="activation_memory_bytes must be an int"):
        placement_policy("auto", activation_memory_bytes=-1)
