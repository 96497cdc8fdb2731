"""Gemini placement: every policy trains to the same numbers, bytes are accounted per pool,
and the device budget holds at every gather and gradient copy."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, make_model

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.gemini import DeviceBudgetExceeded, StaticPlacement
from shardwise.testing import run_ranks

FP16 = MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32)

POLICIES: dict[str, dict[str, Any]] = {
    "cuda": {"placement_policy": "cuda"},
    "cpu": {"placement_policy": "cpu"},
    "static_half": {
        "placement_policy": "static",
        "shard_param_frac": 0.5,
        "offload_optim_frac": 0.5,
    },
    "static_offload": {
        "placement_policy": "static",
        "offload_param_frac": 0.5,
        "offload_optim_frac": 1.0,
    },
}


def _train(
    policy: dict[str, Any], precision: MixedPrecision | None, steps: int = 3
) -> dict[str, Any]:
    rank = dist.get_rank()
    config = {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL, **policy}
    if precision is not None:
        config["mixed_precision"] = precision
    model = make_model()
    wrapped = zero_model_wrapper(model, 3, config)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    gemini = wrapped.gemini_manager
    assert gemini is not None
    losses, moved = [], []
    for step in range(steps):
        before = gemini.bytes_moved()
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, 2))
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss))
        after = gemini.bytes_moved()
        moved.append({k: after[k] - before[k] for k in after})
    return {
        "losses": losses,
        "state": wrapped.state_dict(),
        "pools": gemini.memory_by_pool(),
        "report": gemini.placement_report(),
        "moved": moved,
        "peak": gemini.peak_device_bytes,
    }


@pytest.mark.parametrize("precision", [None, FP16], ids=["fp32", "fp16"])
def test_every_policy_trains_to_the_same_numbers(precision: MixedPrecision | None) -> None:
    results = {
        name: run_ranks(_train, 2, policy, precision)[0] for name, policy in POLICIES.items()
    }
    reference = results["cuda"]
    for name, result in results.items():
        assert result["losses"] == reference["losses"], name
        for key, value in reference["state"].items():
            assert torch.equal(result["state"][key], value), (name, key)


def test_pools_hold_what_the_policy_says() -> None:
    cuda = run_ranks(_train, 2, POLICIES["cuda"], FP16)[0]
    cpu = run_ranks(_train, 2, POLICIES["cpu"], FP16)[0]
    static = run_ranks(_train, 2, POLICIES["static_half"], FP16)[0]
    # Between steps nothing is gathered: "cuda" holds everything on the device, "cpu" nothing.
    assert cuda["pools"]["host"] == 0 and cuda["pools"]["device"] > 0
    assert cpu["pools"]["device"] == 0 and cpu["pools"]["host"] > 0
    assert cpu["pools"]["host"] == cuda["pools"]["device"]
    # "cpu" moves each shard to the device for its gathers and gradients back; "cuda" nothing.
    assert all(set(m.values()) == {0} for m in cuda["moved"])
    assert all(m["to_device"] > 0 and m["to_host"] > 0 for m in cpu["moved"])
    # static: the first half of the chunks sharded, the first half of all optimizer sides on
    # the host, in chunk order.
    report = static["report"]
    count = len(report)
    assert [c["sharded"] for c in report] == [i < -(-count // 2) for i in range(count)]
    trainable = [c for c in report if c["optim"] is not None]
    host = [c["optim"] == "host" for c in trainable]
    assert host == [i < count // 2 for i in range(len(trainable))]


def _over_budget(policy: dict[str, Any], budget: int) -> str:
    try:
        _train({**policy, "device_budget_bytes": budget}, FP16, steps=1)
    except DeviceBudgetExceeded as error:
        return str(error)
    return ""


def test_device_budget_holds_at_every_move() -> None:
    cuda = run_ranks(_train, 2, POLICIES["cuda"], FP16)[0]
    total = cuda["pools"]["device"]
    budget = total // 2
    message = run_ranks(_over_budget, 2, POLICIES["cuda"], budget)[0]
    assert "over its budget" in message and "placement_policy='cpu'" in message
    cpu = run_ranks(_train, 2, {**POLICIES["cpu"], "device_budget_bytes": budget}, FP16)[0]
    assert 0 < cpu["peak"] <= budget
    assert cpu["losses"] == cuda["losses"]


def test_static_fractions_are_validated() -> None:
    with pytest.raises(ValueError, match="apply only to placement_policy='static'"):
        zero_model_wrapper(
            make_model(), 3, {"device": torch.device("cpu"), "offload_optim_frac": 0.5}
        )
    # ColossalAI's static policy warns and offloads no payload while chunks stay gathered.
    with pytest.warns(UserWarning, match="offload_param_frac=0.5 is ignored"):
        half = zero_model_wrapper(
            make_model(),
            3,
            {
                "device": torch.device("cpu"),
                "placement_policy": "static",
                "shard_param_frac": 0.5,
                "offload_param_frac": 0.5,
            },
        )
    assert half.config.placement.policy == StaticPlacement(shard_param_frac=0.5)
    with pytest.raises(ValueError, match=r"offload_optim_frac must be a number in \[0, 1\]"):
        zero_model_wrapper(
            make_model(),
            3,
            {"device": torch.device("cpu"), "placement_policy": "static", "offload_optim_frac": 2},
        )


def _auto(budget: int, margin: float) -> dict[str, Any]:
    policy = {
        "placement_policy": "auto",
        "device_budget_bytes": budget,
        "gpu_margin_mem_ratio": margin,
    }
    result = _train(policy, FP16, steps=3)
    return result


def _auto_stats(budget: int) -> dict[str, Any]:
    rank = dist.get_rank()
    config = {
        "device": torch.device("cpu"),
        "chunk_size_numel": CHUNK_NUMEL,
        "placement_policy": "auto",
        "device_budget_bytes": budget,
        "mixed_precision": FP16,
    }
    model = make_model()
    wrapped = zero_model_wrapper(model, 3, config)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(3):
        optimizer.zero_grad()
        optimizer.backward(wrapped(*batch_slice(step, 0, rank, 2)))
        optimizer.step()
    gemini = wrapped.gemini_manager
    assert gemini is not None and gemini.auto is not None
    return {
        "payloads": [c["payload"] for c in gemini.placement_report() if c["sharded"]],
        "evictions": gemini.auto.evictions,
        "peak": gemini.peak_device_bytes,
        "non_model": max(gemini.auto.non_model),
        "planned": gemini.auto.warmup_peak + gemini.auto.reserved_bytes,
    }


def test_auto_policy_matches_cuda_and_keeps_to_its_budget() -> None:
    cuda = run_ranks(_train, 2, POLICIES["cuda"], FP16)[0]
    roomy = run_ranks(_auto, 2, 10 * cuda["peak"], 1.0)[0]
    assert roomy["losses"] == cuda["losses"]
    for key, value in cuda["state"].items():
        assert torch.equal(roomy["state"][key], value), key
    # With room to spare every shard comes to the device and stays, and the margin takes the
    # optimizer sides there too (the unused branch's chunk last, whole: its gradients are
    # reduced every step all the same).
    assert all(c["payload"] == "device" for c in roomy["report"]), roomy["report"]
    assert all(c["optim"] == "device" for c in roomy["report"] if c["optim"] is not None)
    assert all(set(m.values()) == {0} for m in roomy["moved"][1:])
    # Room for the working set, the traced activations, a prefetch and a twentieth of the
    # model state, less than its shards (a ninth of it in fp16 beside fp32 masters, gradients
    # and Adam's moments): shards must move.
    planned = run_ranks(_auto_stats, 2, 10 * cuda["peak"])[0]["planned"]
    tight_budget = planned + cuda["pools"]["device"] // 20
    tight = run_ranks(_auto, 2, tight_budget, 0.0)[0]
    assert tight["losses"] == cuda["losses"]
    stats = run_ranks(_auto_stats, 2, tight_budget)[0]
    # Under pressure some shards live on the device and the rest in host memory.
    assert "device" in stats["payloads"] and "host" in stats["payloads"]
    assert stats["non_model"] > 0  # activations were traced
    assert stats["peak"] <= tight_budget


def _auto_impossible() -> str:
    try:
        _auto_stats(1000)
    except DeviceBudgetExceeded as error:
        return str(error)
    return ""


def test_auto_policy_says_how_much_is_missing() -> None:
    message = run_ranks(_auto_impossible, 2)[0]
    assert "cannot train within device_budget_bytes=1000" in message
    assert "passes the whole step" in message  # tests/test_working_set_budget.py reruns it
