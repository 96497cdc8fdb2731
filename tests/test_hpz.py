"""ZeRO++ hpZ (`secondary_shard_size`): 4 gloo ranks sharding stage 3 over all 4, with a
secondary copy of each chunk's payload kept over the 2 ranks of each "node" from forward until
backward gathers it there.

The secondary copy holds the payload's exact values, so a run with it is bit-identical to the
same run without it (fp32 and a 16-bit payload); both follow the plain DDP loop within the
tolerance of 4-rank stage 3 (reduce-scatter sums associate otherwise than DDP's all-reduce).

[Note: hpZ traffic]
Without hpZ every gather of a step, forward's and backward's, is an all-gather over the 4
ranks. With it, every chunk forward released with gradients on is gathered in backward over
its 2-rank group instead: the step's all-gathers over 4 ranks fall to forward's, and the
all-gathers over 2 take backward's, each with the same counted payload (the chunk's padded
bytes) and sending half of it (s - 1 / s with s = 2) rather than three quarters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo  # imported once here, not in every rank that builds DDP
from helpers import BranchNet, branch_net_batch, branch_net_ddp
from torch.utils.checkpoint import checkpoint

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.comm import CommOp
from shardwise.testing import run_ranks

STEPS = 4
MAX_NORM = 0.5
CHUNK = 1500
# The branch runs on every rank alike, on even steps: stage 3's gathers are collectives.


def _plain() -> dict[str, torch.Tensor]:
    return branch_net_ddp(STEPS, lambda step: step % 2 == 0, MAX_NORM)


def _sharded(secondary: int | None, **config: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = BranchNet()
    wrapped = zero_model_wrapper(
        model,
        3,
        {
            "device": torch.device("cpu"),
            "chunk_size_numel": CHUNK,
            "secondary_shard_size": secondary,
            **config,
        },
    )
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        max_norm=MAX_NORM,
    )
    stats = wrapped.comm_stats
    losses, gathers, held_after_forward = [], [], []
    for step in range(STEPS):
        x, y = branch_net_batch(step)
        before = stats.snapshot()
        optimizer.zero_grad()
        loss = (wrapped(x, step % 2 == 0) - y).pow(2).mean()
        held_after_forward.append(
            sum(
                c.payload.secondary.numel() * c.payload.secondary.element_size()
                for c in wrapped.chunk_manager.chunks
                if c.payload.secondary is not None
            )
        )
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss))
        after = stats.snapshot()
        gathers.append(
            {
                op.value: {
                    key: after[op.value][key] - before[op.value][key]
                    for key in ("calls", "payload_bytes", "sent_bytes")
                }
                for op in (CommOp.ALL_GATHER, CommOp.SECONDARY_ALL_GATHER)
            }
        )
    left = [c.chunk_id for c in wrapped.chunk_manager.chunks if c.payload.secondary is not None]
    with torch.no_grad():
        wrapped(*branch_net_batch(0)[:1], True)  # an evaluation forward keeps no secondary copy
    kept_in_eval = [
        c.chunk_id for c in wrapped.chunk_manager.chunks if c.payload.secondary is not None
    ]
    return {
        "losses": losses,
        "state": wrapped.state_dict(only_rank_0=False),
        "gathers": gathers,
        "held": held_after_forward,
        "left_after_step": left,
        "kept_in_eval": kept_in_eval,
        "padded_bytes": [
            c.padded_numel * c.payload.full.element_size() for c in wrapped.chunk_manager.chunks
        ],
    }


def _compare(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "plain": _plain(),
        "without": _sharded(None, **config),
        "with": _sharded(2, **config),
    }


FP16_PAYLOAD = MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"mixed_precision": FP16_PAYLOAD},
        {"placement_policy": "auto", "device_budget_bytes": 60_000},
    ],
    ids=["fp32", "fp16-payload", "auto"],
)
def test_hpz_trains_bit_identical_to_stage_3_and_gathers_backward_in_the_group(
    config: dict[str, Any],
) -> None:
    for rank, result in enumerate(run_ranks(_compare, 4, config, timeout_s=240)):
        plain, without, hpz = result["plain"], result["without"], result["with"]
        # Bit-identical to the same stage-3 run without secondary shards.
        assert hpz["losses"] == without["losses"], rank
        for key, value in without["state"].items():
            assert torch.equal(hpz["state"][key], value), (rank, key)
        # And the plain fp32 loop, within 4-rank stage 3's reassociation of the gradient sums.
        # (A 16-bit payload also reduces in 16 bits: there the exact comparison above, with
        # the same run without hpZ, is the test.)
        if "mixed_precision" not in config:
            for key, value in plain.items():
                diff = (hpz["state"][key] - value).abs().max().item()
                assert diff <= 1e-5, (rank, key, diff)
        # See [Note: hpZ traffic]: per step, what went over all 4 ranks without hpZ is split
        # between forward's gathers over 4 and backward's over 2, call for call and byte for
        # byte of payload; none went over 2 without it.
        for step, (a, b) in enumerate(zip(without["gathers"], hpz["gathers"], strict=True)):
            over_all, over_group = b["all_gather"], b["secondary_all_gather"]
            assert a["secondary_all_gather"]["calls"] == 0
            assert over_group["calls"] > 0, (rank, step)
            assert over_all["calls"] + over_group["calls"] == a["all_gather"]["calls"], step
            assert (
                over_all["payload_bytes"] + over_group["payload_bytes"]
                == a["all_gather"]["payload_bytes"]
            ), step
            assert over_group["sent_bytes"] * 2 == over_group["payload_bytes"], step
            assert over_all["sent_bytes"] < a["all_gather"]["sent_bytes"], step
        # Memory: after forward a rank holds half of each chunk released with gradients on
        # (every chunk but those kept gathered into backward), and nothing once the step is
        # done or in an evaluation forward.
        half = sum(result["with"]["padded_bytes"]) // 2
        assert all(0 < held <= half for held in hpz["held"]), (rank, hpz["held"], half)
        assert all(held == 0 for held in without["held"])
        assert hpz["left_after_step"] == [] and hpz["kept_in_eval"] == []


def _refusals() -> list[str]:
    messages = []
    for stage, config in (
        (2, {"secondary_shard_size": 2}),
        (3, {"secondary_shard_size": 2, "shard_size": 2}),
        (3, {"secondary_shard_size": 3}),
        (3, {"secondary_shard_size": 4}),
        (3, {"secondary_shard_size": 0}),
    ):
        try:
            zero_model_wrapper(BranchNet(), stage, {"device": torch.device("cpu"), **config})
        except ValueError as error:
            messages.append(str(error))
        else:
            messages.append("accepted")
    return messages


def test_secondary_shard_size_is_refused_where_it_cannot_be_honoured() -> None:
    messages = run_ranks(_refusals, 4)[0]
    assert "no meaning at stage 2" in messages[0]
    assert "cannot be combined" in messages[1]
    assert "must be a divisor" in messages[2]
    assert "smaller than" in messages[3]
    assert "positive int" in messages[4]


class CheckpointedNet(BranchNet):
    """BranchNet with its middle layer under non-reentrant activation checkpointing: backward
    runs that layer's forward again, gathering its chunk inside backward."""

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(checkpoint(self.mid, h, use_reentrant=False))
        if use_branch:
            h = h + self.branch(h)
        return self.out(h)


def _accumulated(secondary: int | None) -> dict[str, Any]:
    """Two micro-batches per step (both forwards, then both backwards, as an interleaved
    schedule runs them), the middle layer checkpointed."""
    torch.manual_seed(0)
    model = CheckpointedNet()
    config = {"device": torch.device("cpu"), "chunk_size_numel": CHUNK}
    wrapped = zero_model_wrapper(model, 3, {**config, "secondary_shard_size": secondary})
    optimizer = zero_optim_wrapper(
        wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    )
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        first, second = branch_net_batch(2 * step), branch_net_batch(2 * step + 1)
        loss_a = (wrapped(first[0], True) - first[1]).pow(2).mean() / 2
        loss_b = (wrapped(second[0], False) - second[1]).pow(2).mean() / 2
        optimizer.backward(loss_b)
        optimizer.backward(loss_a)
        optimizer.step()
        losses.append(float(loss_a + loss_b))
    secondary_gathers = wrapped.comm_stats.calls(CommOp.SECONDARY_ALL_GATHER)
    return {
        "losses": losses,
        "state": wrapped.state_dict(only_rank_0=False),
        "secondary_gathers": secondary_gathers,
    }


def test_hpz_under_activation_checkpointing_and_interleaved_micro_batches() -> None:
    def both() -> dict[str, Any]:
        return {"without": _accumulated(None), "with": _accumulated(2)}

    for rank, result in enumerate(run_ranks(both, 4, timeout_s=240)):
        without, hpz = result["without"], result["with"]
        assert hpz["secondary_gathers"] > 0 and without["secondary_gathers"] == 0
        assert hpz["losses"] == without["losses"], rank
        for key, value in without["state"].items():
            assert torch.equal(hpz["state"][key], value), (rank, key)
