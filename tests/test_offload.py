"""Optimizer offload: every mode bit-identical to the same run without it, and its copies
counted (see [Note: offload at stages 1 and 2] in engine/packing.py).

At stages 1 and 2 (ColossalAI's `cpu_offload`) the fp32 masters, reduced gradients and
optimizer state live in host memory and the step runs there; on a CPU host the two pools are
the same memory, but every buffer and copy is the one a GPU run makes, so the numbers must
not change by a single bit, and the bytes moved are exactly the gradients going out and the
parameters coming back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, make_model

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.chunk import Pool
from shardwise.testing import run_ranks

STEPS = 4
FP16 = MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32)


def _low_level_run(
    stage: int, offload: bool, fp16: bool, max_norm: float, accum: int
) -> dict[str, Any]:
    rank = dist.get_rank()
    model = make_model(branch="some_ranks")
    config: dict[str, Any] = {"device": torch.device("cpu")}
    if fp16:
        config["mixed_precision"] = FP16
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True),
        initial_scale=2**10,
        max_norm=max_norm,
        optim_config={"reduce_bucket_size": CHUNK_NUMEL, "cpu_offload": offload},
    )
    gemini = wrapped.gemini_manager
    # Placing the chunks copied each master and gradient shard to the host once.
    start = gemini.bytes_moved() if gemini is not None else {}
    losses, moved = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accum):
            loss = wrapped(*batch_slice(step, micro, rank, 2))
            if accum > 1 and micro < accum - 1:
                with wrapped.no_sync():
                    optimizer.backward(loss)
            else:
                optimizer.backward(loss)
            losses.append(float(loss))
        optimizer.step()
        if gemini is not None:
            moved.append({k: v - start[k] for k, v in gemini.bytes_moved().items()})
    chunks = list(wrapped.chunk_manager.trainable_chunks())
    pools = {(c.placement.payload.value, c.placement.optim.value) for c in chunks}
    # What one step moves: each chunk's reduced gradient shard to the host, in the reduction's
    # dtype (once per synchronised backward), its updated parameters back into the payload.
    element = 2 if fp16 else 4
    per_step = {
        "to_host": sum(element * c.shard_numel for c in chunks),
        "to_device": sum(element * c.shard_numel for c in chunks),
        "to_disk": 0,
        "from_disk": 0,
    }
    state = optimizer.optim.state
    return {
        "losses": losses,
        "params": wrapped.state_dict(only_rank_0=False),
        "state_devices": {
            str(v.device) for s in state.values() for v in s.values() if torch.is_tensor(v)
        },
        "state": {
            f"{name}.{key}": value.clone()
            for name, view in optimizer.shard_views.items()
            for key, value in state.get(view, {}).items()
        },
        "pools": pools,
        "moved": moved,
        "per_step": per_step,
        "master_apart": all(c.master is not c.payload.shard for c in chunks),
    }


def _compare_low_level(cases: list[tuple[int, bool, float, int]]) -> list[str]:
    problems = []
    for stage, fp16, max_norm, accum in cases:
        plain = _low_level_run(stage, False, fp16, max_norm, accum)
        offloaded = _low_level_run(stage, True, fp16, max_norm, accum)
        case = f"stage {stage}, fp16 {fp16}, max_norm {max_norm}, accum {accum}"
        if plain["losses"] != offloaded["losses"]:
            problems.append(f"{case}: losses")
        for part in ("params", "state"):
            a, b = plain[part], offloaded[part]
            if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
                problems.append(f"{case}: {part}")
        if plain["pools"] != {("device", "device")}:
            problems.append(f"{case}: plain run placed {plain['pools']}")
        if offloaded["pools"] != {("device", "host")} or not offloaded["master_apart"]:
            problems.append(f"{case}: offloaded run placed {offloaded['pools']}")
        # Every step moves the same bytes (accumulation adds none: no_sync keeps the
        # gradients on the device until the synchronised backward).
        per_step = offloaded["per_step"]
        totals = [
            {k: v * (n + 1) for k, v in per_step.items()} for n in range(len(offloaded["moved"]))
        ]
        if offloaded["moved"] != totals:
            problems.append(f"{case}: moved {offloaded['moved']}, expected {totals}")
    return problems


def test_cpu_offload_at_stages_1_and_2_is_bit_identical_and_moves_what_it_should() -> None:
    cases = [
        (stage, fp16, max_norm, accum)
        for stage in (1, 2)
        for fp16, max_norm, accum in ((False, 0.0, 1), (False, 0.5, 2), (True, 0.5, 1))
    ]
    for problems in run_ranks(_compare_low_level, 2, cases):
        assert problems == []


def _placement_of_a_low_level_model(options: dict[str, Any]) -> str:
    model = make_model()
    try:
        zero_model_wrapper(model, 2, {"device": torch.device("cpu"), **options})
    except ValueError as error:
        return str(error)
    return "accepted"


def test_stage_3_placements_are_refused_at_stages_1_and_2_with_the_fix() -> None:
    (messages,) = run_ranks(
        lambda: [
            _placement_of_a_low_level_model({"placement_policy": "auto"}),
            _placement_of_a_low_level_model({"placement_policy": "static"}),
            _placement_of_a_low_level_model({"placement_policy": "cpu"}),
        ],
        1,
    )
    assert "applies to stage 3" in messages[0] and "cpu_offload" in messages[0]
    assert "applies to stage 3" in messages[1]
    assert messages[2] == "accepted"


def _contradiction() -> str:
    model = make_model()
    wrapped = zero_model_wrapper(
        model, 2, {"device": torch.device("cpu"), "placement_policy": "cpu"}
    )
    try:
        zero_optim_wrapper(
            wrapped,
            torch.optim.AdamW(model.parameters()),
            optim_config={"cpu_offload": False},
        )
    except ValueError as error:
        return str(error)
    return "accepted"


def test_cpu_offload_contradicting_the_placement_is_refused() -> None:
    (message,) = run_ranks(_contradiction, 1)
    assert "contradicts gemini_config['placement_policy']='cpu'" in message


def test_offloaded_pools_are_reported_per_chunk() -> None:
    def placed() -> set[str]:
        model = make_model()
        wrapped = zero_model_wrapper(model, 1, {"device": torch.device("cpu")})
        zero_optim_wrapper(
            wrapped, torch.optim.AdamW(model.parameters()), optim_config={"cpu_offload": True}
        )
        return {c.placement.optim.value for c in wrapped.chunk_manager.trainable_chunks()}

    (pools,) = run_ranks(placed, 1)
    assert pools == {Pool.HOST.value}
