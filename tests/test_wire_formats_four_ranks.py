"""Wire formats on 4 ranks (tests/test_wire_formats.py for what is exact and what is compared
with a tolerance, and why): hpZ's backward decodes what forward received, hybrid sharding
quantizes each level and keeps its replicas alike, and int4 reductions, each against the plain
loop over BranchNet, whose branch some steps skip, leaving its parameters without gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo  # imported once here, not in every rank that builds DDP
import torch.distributed as dist
from helpers import (
    BranchNet,
    branch_net_batch,
    max_abs_diff,
)
from wire_checks import (
    INT4_TOLERANCES,
    STEPS,
    all_gather,
    assert_close,
    gather_round,
    reduce_wire_checks,
    reduced_grad_checks,
)

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.comm import CommOp
from shardwise.testing import run_ranks


def _branch_net_start() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return BranchNet().state_dict()


def _branch_local_grads() -> list[list[torch.Tensor | None]]:
    """Each rank's gradients of step 0's batch on `BranchNet` from its start, per parameter,
    computed without the engine."""
    grads = []
    for rank in range(dist.get_world_size()):
        torch.manual_seed(0)
        net = BranchNet()
        x, y = branch_net_batch(0, rank)
        (net(x, True) - y).pow(2).mean().backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in net.parameters()])
    return grads


def _branch_plain() -> dict[str, Any]:
    """The plain loop `_branch_run` stands for, as a user writes it: DDP with
    `find_unused_parameters=True`, `clip_grad_norm_`, AdamW; this rank's losses and the
    weights."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = BranchNet()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        x, y = branch_net_batch(step)
        optimizer.zero_grad()
        loss = (ddp(x, step % 2 == 0) - y).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": model.state_dict()}


def _branch_run(stage: int = 3, grad_check: bool = False, **formats: Any) -> dict[str, Any]:
    """test_hpz's BranchNet at `stage` on 4 ranks, with the settings given; with `grad_check`,
    the first step's reduced gradients are checked against the plain loop's
    (`reduced_grad_checks`)."""
    torch.manual_seed(0)
    model = BranchNet()
    config: dict[str, Any] = {"device": torch.device("cpu"), **formats}
    optim_config = None
    if stage == 3:
        config["chunk_size_numel"] = 1500
    else:
        optim_config = {"reduce_bucket_size": 1500}
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        max_norm=0.5,
        optim_config=optim_config,
    )
    chunks = list(wrapped.chunk_manager.trainable_chunks())
    losses, grad_checks = [], None
    for step in range(STEPS):
        x, y = branch_net_batch(step)
        optimizer.zero_grad()
        loss = (wrapped(x, step % 2 == 0) - y).pow(2).mean()
        optimizer.backward(loss)
        if step == 0 and grad_check:
            grad_checks = reduced_grad_checks(
                chunks, list(model.parameters()), _branch_local_grads()
            )
        optimizer.step()
        losses.append(float(loss.detach()))
    stats = wrapped.comm_stats
    replicas_agree = True
    replicate = wrapped.chunk_manager.topology.replicate
    if replicate is not None:  # the same shard in every shard group holds the same values
        for chunk in chunks:
            rows = all_gather(chunk.master, replicate)
            replicas_agree &= all(torch.equal(row, rows[0]) for row in rows)
    return {
        "losses": losses,
        "state": wrapped.state_dict(only_rank_0=False),
        "sent": {
            op.value: (stats.calls(op), stats.payload_bytes(op), stats.sent_bytes(op))
            for op in CommOp
        },
        "totals": {
            op.value: (stats.sent_bytes(op), stats.unquantized_sent_bytes(op)) for op in CommOp
        },
        "replicas_agree": replicas_agree,
        "checks": gather_round(chunks, stats),
        "grad_checks": grad_checks,
    }


def _four_rank_cases() -> dict[str, Any]:
    return {
        "int8": _branch_run(gather_format="int8", reduce_format="int8"),
        "int8 hpZ": _branch_run(gather_format="int8", reduce_format="int8", secondary_shard_size=2),
        "hybrid": _branch_run(shard_size=2),
        "hybrid int8+int8": _branch_run(shard_size=2, gather_format="int8", reduce_format="int8"),
        "reduce_wire int4": reduce_wire_checks("int4", shard_numel=51),
        "plain": _branch_plain(),
        "2/int4": _branch_run(2, grad_check=True, reduce_format="int4"),
        "3/int4": _branch_run(3, grad_check=True, reduce_format="int4"),
        "3/int8": _branch_run(3, reduce_format="int8"),
        "int8+int4": _branch_run(gather_format="int8", reduce_format="int4"),
        "int8+int4 hpZ": _branch_run(
            gather_format="int8", reduce_format="int4", secondary_shard_size=2
        ),
        "hybrid int4": _branch_run(shard_size=2, reduce_format="int4"),
        "hybrid int8+int4": _branch_run(shard_size=2, gather_format="int8", reduce_format="int4"),
    }


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(_four_rank_cases, 4, timeout_s=600)


@pytest.mark.parametrize(
    ("plain_case", "hpz_case"), [("int8", "int8 hpZ"), ("int8+int4", "int8+int4 hpZ")]
)
def test_hpz_backward_decodes_what_forward_received(
    four_ranks: list[dict[str, Any]], plain_case: str, hpz_case: str
) -> None:
    """int8 gathers (and int8 or int4 reductions, over all 4 ranks) with secondary shards equal
    the same without them, bit for bit: backward's gathers inside the 2-rank groups carry
    forward's records (see [Note: quantized gathers and hpZ]), counted as secondary
    all-gathers of records."""
    for rank_result in four_ranks:
        plain, hpz = rank_result[plain_case], rank_result[hpz_case]
        assert hpz["losses"] == plain["losses"]
        assert max_abs_diff(hpz["state"], plain["state"]) == 0.0
        assert all(hpz["checks"].values()), hpz["checks"]
        calls, payload, _ = hpz["sent"]["secondary_all_gather"]
        assert calls > 0 and plain["sent"]["secondary_all_gather"] == (0, 0, 0)
        # Backward's gathers moved off the 4-rank group, record for record.
        assert payload + hpz["sent"]["all_gather"][1] == plain["sent"]["all_gather"][1]


def test_hybrid_sharding_quantizes_each_level_and_keeps_replicas_alike(
    four_ranks: list[dict[str, Any]],
) -> None:
    for rank_result in four_ranks:
        plain, quantized = rank_result["hybrid"], rank_result["hybrid int8+int8"]
        assert plain["replicas_agree"] and quantized["replicas_agree"]
        assert all(quantized["checks"].values()), quantized["checks"]
        assert_close(quantized, plain["losses"], plain["state"], _branch_net_start())
        # Fewer bytes, the same calls; a chunk of this net may be as small as 24 values,
        # whose 12-value shards send 16 bytes for 48 (the exact count per gather is
        # `round_bytes_as_counted`).
        for op in ("all_gather", "reduce_scatter"):
            assert quantized["sent"][op][0] == plain["sent"][op][0]
            assert quantized["sent"][op][1] / plain["sent"][op][1] <= 0.35
        # What the quantized run would have sent unquantized is what the plain one sent.
        assert sum(u for _, u in quantized["totals"].values()) == sum(
            s for s, _ in plain["totals"].values()
        )
        # Across the replicas a rank sends, of its fp32 gradient shard's bytes, a quarter
        # (the quantized reduce-scatter) and one (the exact all-gather of the sums), where the
        # plain all-reduce sends two: 1.254 / 2.
        replicated = quantized["sent"]["replicate_all_reduce"][2]
        assert replicated / plain["sent"]["replicate_all_reduce"][2] == pytest.approx(
            0.627, abs=0.01
        )


def test_int4_reductions_on_four_ranks(four_ranks: list[dict[str, Any]]) -> None:
    """Each owner adds 3 round trips: on the wire exactly and within their bound (an odd
    shard, counted bytes, an overflow as nan); the first step's gradients at stages 2 and 3
    exactly so and within the bound of the plain loop's; 4 steps close to the plain DDP
    loop, with half of int8's reduce-scatter bytes plus the scales."""
    for rank_result in four_ranks:
        assert all(rank_result["reduce_wire int4"].values()), rank_result["reduce_wire int4"]
        plain = rank_result["plain"]
        start = _branch_net_start()
        for case in ("2/int4", "3/int4"):
            checks = rank_result[case]["grad_checks"]
            assert checks["exact"] and checks["within_bound"] and checks["moved"], checks
            assert 0.8 < checks["worst_share"] <= 1.0, checks
            assert_close(
                rank_result[case], plain["losses"], plain["state"], start, *INT4_TOLERANCES
            )
        calls_4, bytes_4, _ = rank_result["3/int4"]["sent"]["reduce_scatter"]
        calls_8, bytes_8, _ = rank_result["3/int8"]["sent"]["reduce_scatter"]
        # Small chunks here (shards of 12 to a few hundred values, values padded to 4 bytes):
        # above the large-shard (0.5 + 4 / 256) / (1 + 4 / 256) = 0.508.
        assert calls_4 == calls_8 > 0 and 0.5 < bytes_4 / bytes_8 < 0.6


def test_hybrid_sharding_quantizes_each_level_in_int4_and_keeps_replicas_alike(
    four_ranks: list[dict[str, Any]],
) -> None:
    """int4 reductions inside the shard groups and across the replicas (with int8 gathers or
    without): replicas equal, close to the plain DDP loop and to the unquantized hybrid run,
    and the replicas' exchange sends a reduce-scatter of int4 records and an exact all-gather
    of the sums: (0.129 + 1) / 2 of the plain all-reduce's fp32 bytes."""
    for rank_result in four_ranks:
        plain, hybrid = rank_result["plain"], rank_result["hybrid"]
        for case, gathers_quantized in (("hybrid int4", False), ("hybrid int8+int4", True)):
            quantized = rank_result[case]
            assert quantized["replicas_agree"], case
            checks = dict(quantized["checks"])
            assert checks.pop("others_moved") is gathers_quantized, case
            assert all(checks.values()), checks
            for reference_run in (plain, hybrid):
                assert_close(
                    quantized,
                    reference_run["losses"],
                    reference_run["state"],
                    _branch_net_start(),
                    *INT4_TOLERANCES,
                )
            assert quantized["sent"]["reduce_scatter"][0] == hybrid["sent"]["reduce_scatter"][0]
            replicated = quantized["sent"]["replicate_all_reduce"][2]
            assert replicated / hybrid["sent"]["replicate_all_reduce"][2] == pytest.approx(
                0.5645, abs=0.01
            )
