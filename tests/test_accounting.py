"""Collectives counted against the ZeRO analysis, model-state bytes against the ZeRO formula.

Psi is the number of trainable parameters (a tied weight once); fp32 throughout, so a parameter,
a gradient and an Adam moment each take 4 bytes. Per step and rank, a bandwidth-optimal
all-gather or reduce-scatter of Psi elements sends Psi * 4 * (N-1)/N bytes: stage 2 sends two of
them (2 Psi), stage 3 three (3 Psi: gather for forward, again for backward, reduce-scatter
of gradients), less one gather of the chunks backward starts with, which stay gathered from
the end of forward. Stage 1 sends three (3 Psi): its backward averages the whole gradient on
every rank, as DDP does, so that `.grad` shows the average (an all-reduce, 2 Psi: see [Note:
stage 1 averages in backward] in chunk/grads.py), and its step all-gathers the parameters.
The engine adds only chunk padding (under N elements a chunk), one all-reduce of the gradient
norm and, at stage 1, one of a flag per tensor (which `.grad` to show, as DDP's map of used
parameters). On gloo the engine reduce-scatters gradients with an all-to-all and a
local sum (gloo's own reduce-scatter is slow: see the note in comm/collectives.py), which sends
what a reduce-scatter sends; the all-reduce method is checked against its own count (one psi
more per step).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, CONFIG, batch_slice

from shardwise import CommOp, zero_model_wrapper, zero_optim_wrapper
from shardwise.chunk import ChunkState
from shardwise.comm import ReduceScatterMethod
from shardwise.engine.config import gradient_reduction_method
from shardwise.testing import GPT, run_ranks


def _measure(stage: int, reduction: str = "reduce_scatter") -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(CONFIG)  # every parameter used every step
    psi = sum(p.numel() for p in model.parameters())
    config: dict[str, object] = {"device": torch.device("cpu"), "gradient_reduction": reduction}
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        optim_config={"reduce_bucket_size": CHUNK_NUMEL} if stage < 3 else None,
    )
    sent = []
    for step in range(3):
        wrapped.comm_stats.reset()
        optimizer.zero_grad()
        _, loss = wrapped(*batch_slice(step, 0, rank, world))
        # Stage 3 keeps the chunks backward starts with gathered from the end of forward.
        kept = [c for c in wrapped.chunk_manager.chunks if c.payload.state is ChunkState.GATHERED]
        optimizer.backward(loss)
        optimizer.step()
        sent.append(wrapped.comm_stats.sent_bytes())
    memory = wrapped.memory_report()
    return {
        "psi": psi,
        "world": world,
        "sent_first": sent[0],
        "sent": sent[-1],
        "gathers": wrapped.comm_stats.calls(CommOp.ALL_GATHER),
        "chunks": len(wrapped.chunk_manager.chunks),
        "kept_for_backward": len(kept) if stage == 3 else 0,
        "kept_numel": sum(c.padded_numel for c in kept) if stage == 3 else 0,
        "model_state": sum(memory.values()) + optimizer.state_bytes(),
        "grads": memory["grads"],
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("stage", "psi_multiple"), [(1, 3), (2, 2), (3, 3)])
@pytest.mark.parametrize("reduction", ["reduce_scatter", "auto"])
def test_bytes_sent_per_step_match_zero_analysis(
    stage: int, psi_multiple: int, world: int, reduction: str
) -> None:
    result = run_ranks(_measure, world, stage, reduction)[0]
    # The chunks kept gathered from forward into backward are gathered once, not twice.
    elements = psi_multiple * result["psi"] - result["kept_numel"]
    theory = elements * 4 * (world - 1) / world
    assert 1.0 <= result["sent"] / theory <= 1.02
    if stage == 3:
        # Two gathers per chunk per step (forward, backward), once the order is recorded,
        # but for the chunk kept between them (the tied embedding and head).
        assert result["kept_for_backward"] == 1
        assert result["gathers"] == 2 * result["chunks"] - 1


@pytest.mark.parametrize("world", [2, 4])
def test_model_state_bytes_per_rank_match_zero_formula(world: int) -> None:
    results = {stage: run_ranks(_measure, world, stage)[0] for stage in (1, 2, 3)}
    psi = results[1]["psi"]
    # ZeRO's formula with fp32 parameters and gradients (4 bytes) and Adam (K = 8 bytes).
    formula = {
        1: 4 * psi + 4 * psi + 8 * psi / world,
        2: 4 * psi + (4 + 8) * psi / world,
        3: (4 + 4 + 8) * psi / world,
    }
    # Stage 1's reduced slice, which the optimizer reads, lives in the whole local gradient
    # buffer (this rank's own part of it), so no stage holds more than the formula.
    for stage, result in results.items():
        assert 1.0 <= result["model_state"] / formula[stage] <= 1.03, stage


@pytest.mark.parametrize("stage", [2, 3])
def test_all_reduce_method_sends_one_psi_more(stage: int) -> None:
    world = 2
    result = run_ranks(_measure, world, stage, "all_reduce")[0]
    elements = (2 if stage == 2 else 3) * result["psi"] - result["kept_numel"]
    theory = elements * 4 * (world - 1) / world
    extra = result["psi"] * 4 * (world - 1) / world
    assert 1.0 <= result["sent"] / (theory + extra) <= 1.02


def test_auto_reduction_exchanges_slices_on_gloo() -> None:
    def resolve() -> str:
        return gradient_reduction_method("auto", None).value

    assert run_ranks(resolve, 2) == ["all_to_all", "all_to_all"]
    assert gradient_reduction_method("all_reduce", None) is ReduceScatterMethod.ALL_REDUCE
    with pytest.raises(ValueError, match="gradient_reduction must be one of"):
        gradient_reduction_method("ring", None)


def test_device_bytes_shortcut_agrees_with_the_pools() -> None:
    """The memory manager's per-chunk shortcut counts what `resident_bytes_by_pool` puts in the
    device pool, whatever the placement and gradient layout."""
    from torch import nn

    from shardwise import ChunkManager
    from shardwise.chunk import Pool
    from shardwise.chunk.accounting import device_resident_bytes, resident_bytes_by_pool

    for keep_gathered in (True, False):
        model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
        manager = ChunkManager(
            chunk_size_numel=40, device=torch.device("cpu"), keep_gathered=keep_gathered
        )
        manager.register(model.named_parameters())
        for chunk in manager.chunks:
            if keep_gathered:
                chunk.share_grad_shard_with_full()
            for payload in (Pool.DEVICE, Pool.HOST) if not keep_gathered else (Pool.DEVICE,):
                for optim in (Pool.DEVICE, Pool.HOST):
                    chunk.place(payload=payload, optim=optim)
                    expected = resident_bytes_by_pool(chunk)[Pool.DEVICE]
                    assert device_resident_bytes(chunk) == expected, (keep_gathered, payload, optim)


def _cached_counts_agree_with_a_fresh_count() -> int:
    """Every budget check of a stage-3 run under "auto" (with evictions) compares the cached
    device bytes with a count from scratch."""
    from helpers import CHUNK_NUMEL, batch_slice, make_model

    from shardwise import zero_model_wrapper, zero_optim_wrapper
    from shardwise.chunk import Pool
    from shardwise.chunk.accounting import device_resident_bytes, transient_bytes
    from shardwise.gemini import Room

    model = make_model()
    config = {
        "device": torch.device("cpu"),
        "chunk_size_numel": CHUNK_NUMEL,
        "placement_policy": "auto",
        "device_budget_bytes": 200_000,
    }
    wrapped = zero_model_wrapper(model, 3, config)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    gemini = wrapped.gemini_manager
    assert gemini is not None
    checks = 0
    check = gemini.check_budget

    def checked(where: str, *reductions: Any) -> Room:
        nonlocal checks
        fresh = sum(
            device_resident_bytes(c)
            + (c.optimizer_state.nbytes() if c.placement.optim is Pool.DEVICE else 0)
            for c in gemini.chunk_manager.chunks
        )
        assert gemini.tally.device_bytes() == fresh, where
        in_flight = sum(transient_bytes(c) for c in gemini.chunk_manager.chunks)
        assert gemini.tally.transient_bytes() == in_flight, where
        checks += 1
        return check(where, *reductions)

    gemini.check_budget = checked  # type: ignore[method-assign]
    for step in range(3):
        optimizer.zero_grad()
        optimizer.backward(wrapped(*batch_slice(step, 0, dist.get_rank(), 2)))
        optimizer.step()
    assert sum(gemini.bytes_moved().values()) > 0  # shards went between the pools
    return checks


def test_cached_device_bytes_match_a_fresh_count_at_every_check() -> None:
    assert all(checks > 20 for checks in run_ranks(_cached_counts_agree_with_a_fresh_count, 2))


def _accumulation_calls(stage: int) -> dict[str, Any]:
    """Collectives of one step of three micro-batches, the first two under `no_sync()`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    wrapped = zero_model_wrapper(model, stage, {"device": torch.device("cpu")})
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        optim_config={"reduce_bucket_size": CHUNK_NUMEL},
    )
    stats = wrapped.comm_stats
    kinds = (CommOp.ALL_REDUCE, CommOp.REDUCE_SCATTER, CommOp.ALL_GATHER)
    seen: dict[str, Any] = {"chunks": len(list(wrapped.chunk_manager.trainable_chunks()))}
    optimizer.zero_grad()
    for micro in range(3):
        _, loss = wrapped(*batch_slice(0, micro, rank, world))
        stats.reset()
        if micro < 2:
            with wrapped.no_sync():
                optimizer.backward(loss / 3)
        else:
            optimizer.backward(loss / 3)
        seen[f"backward {micro}"] = {kind.value: stats.calls(kind) for kind in kinds}
    stats.reset()
    optimizer.step()
    seen["step"] = {kind.value: stats.calls(kind) for kind in kinds}
    return seen


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_reduces_once_per_synchronised_backward(stage: int) -> None:
    # Under no_sync() no collective runs; the backward outside reduces each chunk once (stage
    # 1: an all-reduce, and one of the flags that say which `.grad` to show; stage 2: a
    # reduce-scatter); the step then reduces no gradient again: one all-reduce (the norm) and
    # the all-gathers of the updated parameters, as after a single backward.
    for seen in run_ranks(_accumulation_calls, 2, stage):
        chunks = seen["chunks"]
        assert chunks > 1
        nothing = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
        assert seen["backward 0"] == seen["backward 1"] == nothing
        if stage == 1:
            synced = {"all_reduce": chunks + 1, "reduce_scatter": 0, "all_gather": 0}
        else:
            synced = {"all_reduce": 0, "reduce_scatter": chunks, "all_gather": 0}
        assert seen["backward 2"] == synced
        assert seen["step"] == {"all_reduce": 1, "reduce_scatter": 0, "all_gather": chunks}
