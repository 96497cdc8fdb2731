"""Hybrid sharding: 4 gloo ranks as 2 shard groups of 2 (`shard_size=2`).

The reference is the plain loop a user runs without shardwise: DistributedDataParallel over
the same 4 ranks with `find_unused_parameters=True`, `zero_grad()`, `backward()`,
`clip_grad_norm_`, `optimizer.step()`, same seed and batches. DDP sums each gradient over 4
ranks in one all-reduce; hybrid sharding sums over the 2 ranks of a group, then over the 2
groups, so the sums associate differently: fp32 within 1e-6 here (measured below 3e-7).

[Note: traffic across shard groups]
With R shard groups of s ranks, each rank's reduced gradient shard (1/s of every chunk's
padded gradient, in the reduction dtype) is all-reduced once per step across the R groups:
a ring all-reduce sends 2 (R - 1) / R of it. With R = s = 2 and fp32 gradients that is
4 x padded_numel / 2 bytes per rank and step, the whole of what crosses groups; all-gathers and
reduce-scatters stay inside a group (their counted payloads are a chunk's, over 2 ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # imported once here, not in every rank that builds DDP
import torch.distributed as dist
from helpers import BranchNet, branch_net_batch, branch_net_ddp
from torch.nn.parallel import DistributedDataParallel

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.checkpoint import load, save
from shardwise.comm import CommOp
from shardwise.testing import run_ranks

STEPS = 5
MAX_NORM = 0.5


def _use_branch(stage: int, step: int) -> bool:
    # Stages 1-2: on rank 2 only (another shard group's gradient must still count); stage 3,
    # where every rank must call the same modules: on every rank, on even steps.
    return dist.get_rank() == 2 if stage < 3 else step % 2 == 0


def _plain(stage: int) -> dict[str, torch.Tensor]:
    return branch_net_ddp(STEPS, lambda step: _use_branch(stage, step), MAX_NORM)


def _hybrid(
    stage: int, shard_size: int | None, chunk: int = 1500, **placement: Any
) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = BranchNet()
    config: dict[str, Any] = {
        "device": torch.device("cpu"),
        "shard_size": shard_size,
        **placement,
    }
    if stage == 3:
        config["chunk_size_numel"] = chunk
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        max_norm=MAX_NORM,
        optim_config={"reduce_bucket_size": chunk} if stage < 3 else None,
    )
    return wrapped, optimizer


def _train(stage: int) -> dict[str, Any]:
    reference = _plain(stage)
    wrapped, optimizer = _hybrid(stage, shard_size=2)
    crossing = []
    for step in range(STEPS):
        x, y = branch_net_batch(step)
        before = wrapped.comm_stats.sent_bytes(CommOp.REPLICATE_ALL_REDUCE)
        optimizer.zero_grad()
        optimizer.backward((wrapped(x, _use_branch(stage, step)) - y).pow(2).mean())
        optimizer.step()
        crossing.append(wrapped.comm_stats.sent_bytes(CommOp.REPLICATE_ALL_REDUCE) - before)
    final = wrapped.state_dict(only_rank_0=False)
    chunks = list(wrapped.chunk_manager.trainable_chunks())
    return {
        "diff": max((final[k] - reference[k]).abs().max().item() for k in reference),
        "crossing": crossing,
        "padded_numel": sum(c.padded_numel for c in chunks),
        "shard_numel": sum(c.shard_numel for c in chunks),
        "chunk_world": {c.world_size for c in wrapped.chunk_manager.chunks},
        "gather_calls": wrapped.comm_stats.calls(CommOp.ALL_GATHER),
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_groups_of_two_match_ddp_and_send_one_shard_across(stage: int) -> None:
    for result in run_ranks(_train, 4, stage, timeout_s=240):
        assert result["diff"] < 1e-6, result["diff"]
        assert result["chunk_world"] == {2}  # sharded over the group, not all 4 ranks
        assert result["shard_numel"] * 2 == result["padded_numel"]
        # See [Note: traffic across shard groups]: 2 (R - 1) / R of the fp32 shard.
        assert result["crossing"] == [4 * result["padded_numel"] // 2] * STEPS


def _accumulating(stage: int) -> dict[str, Any]:
    """Two micro-batches per step: the gradient shards cross the groups once per step."""
    torch.manual_seed(0)
    model = BranchNet()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    plain_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    wrapped, optimizer = _hybrid(stage, shard_size=2)
    crossing = []
    for step in range(STEPS):
        plain_optimizer.zero_grad()
        optimizer.zero_grad()
        before = wrapped.comm_stats.sent_bytes(CommOp.REPLICATE_ALL_REDUCE)
        for micro in range(2):
            x, y = branch_net_batch(2 * step + micro)
            ((ddp(x, True) - y).pow(2).mean() / 2).backward()
            optimizer.backward((wrapped(x, True) - y).pow(2).mean() / 2)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        plain_optimizer.step()
        optimizer.step()
        crossing.append(wrapped.comm_stats.sent_bytes(CommOp.REPLICATE_ALL_REDUCE) - before)
    final = wrapped.state_dict(only_rank_0=False)
    padded = sum(c.padded_numel for c in wrapped.chunk_manager.trainable_chunks())
    return {
        "diff": max((final[k] - v).abs().max().item() for k, v in model.state_dict().items()),
        "crossing": crossing,
        "padded_numel": padded,
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_accumulated_gradients_cross_the_groups_once_per_step(stage: int) -> None:
    for result in run_ranks(_accumulating, 4, stage, timeout_s=240):
        assert result["diff"] < 1e-6, result["diff"]
        assert result["crossing"] == [4 * result["padded_numel"] // 2] * STEPS


def _auto_placement() -> dict[str, Any]:
    """Stage 3 under "auto" placement with a budget that moves shards (its decisions to finish
    reductions in flight are each rank's own; nothing crosses the groups there)."""
    reference = _plain(3)
    wrapped, optimizer = _hybrid(3, 2, placement_policy="auto", device_budget_bytes=80_000)
    for step in range(STEPS):
        x, y = branch_net_batch(step)
        optimizer.zero_grad()
        optimizer.backward((wrapped(x, _use_branch(3, step)) - y).pow(2).mean())
        optimizer.step()
    final = wrapped.state_dict(only_rank_0=False)
    gemini = wrapped.gemini_manager
    return {
        "diff": max((final[k] - reference[k]).abs().max().item() for k in reference),
        "moved": sum(gemini.bytes_moved().values()),
    }


def test_auto_placement_with_shard_groups_matches_ddp() -> None:
    for result in run_ranks(_auto_placement, 4, timeout_s=240):
        assert result["diff"] < 1e-6, result["diff"]
        assert result["moved"] > 0


def _save_hybrid_load_elsewhere(directory: Path) -> dict[str, Any]:
    wrapped, optimizer = _hybrid(3, shard_size=2)
    for step in range(2):
        x, y = branch_net_batch(step)
        optimizer.zero_grad()
        optimizer.backward((wrapped(x, True) - y).pow(2).mean())
        optimizer.step()
    save(directory / "hybrid", wrapped, optimizer, extra={"step": 2})
    expected = wrapped.state_dict(only_rank_0=False)
    # The same checkpoint into full sharding over all 4 ranks, at another chunk size.
    other, other_optimizer = _hybrid(3, shard_size=None, chunk=900)
    extra = load(directory / "hybrid", other, other_optimizer)
    loaded = other.state_dict(only_rank_0=False)
    return {
        "extra": extra,
        "same": all(torch.equal(loaded[k], v) for k, v in expected.items()),
        "expected": expected,
    }


def _load_on_two(directory: Path) -> dict[str, torch.Tensor]:
    wrapped, optimizer = _hybrid(2, shard_size=None)
    load(directory / "hybrid", wrapped, optimizer)
    return dict(wrapped.state_dict(only_rank_0=False))


def test_a_hybrid_checkpoint_loads_at_another_layout(tmp_path: Path) -> None:
    results = run_ranks(_save_hybrid_load_elsewhere, 4, tmp_path, timeout_s=240)
    for result in results:
        assert result["extra"] == {"step": 2}
        assert result["same"]
    # And on 2 ranks at stage 2.
    expected = results[0]["expected"]
    for loaded in run_ranks(_load_on_two, 2, tmp_path, timeout_s=120):
        assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_shard_size_must_divide_the_ranks() -> None:
    def build() -> str:
        try:
            _hybrid(2, shard_size=3)
        except ValueError as error:
            return str(error)
        return ""

    for message in run_ranks(build, 4):
        assert "shard_size=3 does not divide the 4 data-parallel ranks" in message
