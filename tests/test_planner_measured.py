"""The planner's predictions against what the engine measures, and its advice put to use."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, CONFIG, batch_slice

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.planner import plan
from shardwise.testing import GPT, GPTConfig, run_ranks

SMALL = GPTConfig(vocab_size=96, block_size=8, n_layer=1, n_head=2, n_embd=24)


def _measure(config: GPTConfig, stage: int, precision: MixedPrecision) -> int:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(config)
    options: dict[str, Any] = {"device": torch.device("cpu"), "mixed_precision": precision}
    if stage == 3:
        options["chunk_size_numel"] = CHUNK_NUMEL
    wrapped = zero_model_wrapper(model, stage, options)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        optim_config={"reduce_bucket_size": CHUNK_NUMEL} if stage < 3 else None,
    )
    optimizer.zero_grad()
    idx, targets = batch_slice(0, 0, rank, 2)
    _, loss = wrapped(idx % config.vocab_size, targets % config.vocab_size)
    optimizer.backward(loss)
    optimizer.step()
    return sum(wrapped.memory_report().values()) + optimizer.state_bytes()


@pytest.mark.parametrize("config", [CONFIG, SMALL], ids=["gpt", "small"])
@pytest.mark.parametrize(
    "precision",
    [MixedPrecision(), MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32)],
    ids=["fp32", "fp16-storage"],
)
def test_predicted_model_state_within_3_percent_of_measured(
    config: GPTConfig, precision: MixedPrecision
) -> None:
    prediction = plan(
        GPT(config),
        world_size=2,
        device_memory_bytes=10**12,
        host_memory_bytes=10**12,
        param_dtype=precision.param_dtype,
        compute_dtype=precision.compute_dtype,
        chunk_size_numel=CHUNK_NUMEL,
    )
    by_stage = {o.stage: o for o in prediction.options if o.placement == "cuda"}
    for stage in (1, 2, 3):
        measured = run_ranks(_measure, 2, config, stage, precision)[0]
        predicted = by_stage[stage].device.total
        assert abs(predicted - measured) / measured <= 0.03, (stage, predicted, measured)


def _train_as_planned(
    zero_stage: int, gemini_config: dict[str, Any], optim_config: dict[str, Any]
) -> list[float]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    wrapped = zero_model_wrapper(
        model, zero_stage, {"device": torch.device("cpu"), **gemini_config}
    )
    optimizer = zero_optim_wrapper(
        wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2), optim_config=optim_config or None
    )
    losses = []
    for step in range(4):
        optimizer.zero_grad()
        _, loss = wrapped(*batch_slice(step % 2, 0, rank, 2))
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss.detach()))
    if wrapped.gemini_manager is not None:
        # The budget bounds model state; activations that do not fit beside the working set
        # stay on the device under any placement (see [Note: auto placement]).
        assert wrapped.gemini_manager.peak_model_device_bytes <= gemini_config.get(
            "device_budget_bytes", 10**12
        )
    return losses


def test_recommended_configuration_fits_its_budget_and_trains() -> None:
    model = GPT(CONFIG)
    full = plan(model, world_size=2, device_memory_bytes=10**12, host_memory_bytes=10**12)
    ddp_bytes = full.options[0].device.total
    # A device too small for stages 0-2 but large enough for sharded parameters.
    budget = int(ddp_bytes * 0.45)
    advice = plan(
        model, world_size=2, device_memory_bytes=budget, host_memory_bytes=10**12,
        chunk_size_numel=CHUNK_NUMEL,
    )  # fmt: skip
    assert advice.zero_stage == 3
    config = {**advice.gemini_config, "device_budget_bytes": budget}
    losses = run_ranks(_train_as_planned, 2, 3, config, advice.optim_config)[0]
    assert losses[-1] < losses[0]


def _measure_pools(directory: str, stage: int) -> dict[str, int]:
    """Bytes per pool after a step with every master and optimizer state on the disk tier."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    options: dict[str, Any] = {
        "device": torch.device("cpu"),
        "nvme_offload_fraction": 1.0,
        "nvme_offload_dir": directory,
    }
    if stage == 3:
        options.update(placement_policy="cpu", chunk_size_numel=CHUNK_NUMEL)
    wrapped = zero_model_wrapper(model, stage, options)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        optim_config={"reduce_bucket_size": CHUNK_NUMEL, "cpu_offload": True}
        if stage < 3
        else None,
    )
    optimizer.zero_grad()
    _, loss = wrapped(*batch_slice(0, 0, rank, 2))
    optimizer.backward(loss)
    optimizer.step()
    assert wrapped.gemini_manager is not None
    pools = wrapped.gemini_manager.memory_by_pool()
    optimizer.close()
    return pools


@pytest.mark.parametrize("stage", [2, 3])
def test_predicted_pools_of_the_disk_tier_within_3_percent_of_measured(
    stage: int, tmp_path: Any
) -> None:
    prediction = plan(
        GPT(CONFIG),
        world_size=2,
        device_memory_bytes=10**12,
        host_memory_bytes=10**12,
        disk_memory_bytes=10**12,
        chunk_size_numel=CHUNK_NUMEL,
    )
    (option,) = [o for o in prediction.options if (o.stage, o.placement) == (stage, "disk")]
    measured = run_ranks(_measure_pools, 2, str(tmp_path), stage)[0]
    for pool, predicted in (
        ("device", option.device.total),
        ("host", option.host.total),
        ("disk", option.disk.total),
    ):
        assert abs(predicted - measured[pool]) <= 0.03 * measured[pool], (pool, option, measured)
