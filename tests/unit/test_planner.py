"""The planner's formulas, the ZeRO paper's Figure 1, and the command line."""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.cli import main
from shardwise.planner import ModelSpec, engine_bytes, plan, zero_paper_bytes


def test_zero_paper_figure_1_digit_for_digit() -> None:
    # Psi = 7.5B, N = 64, K = 12, fp16 parameters and gradients: 120, 31.4, 16.6, 1.9 GB.
    figures = [f"{zero_paper_bytes(stage, 7.5e9, 64) / 1e9:.1f}" for stage in (0, 1, 2, 3)]
    assert figures == ["120.0", "31.4", "16.6", "1.9"]


@pytest.mark.parametrize(
    ("stage", "expected"),
    [(0, 16 * 100), (1, 4 * 100 + 12 * 100 / 4), (2, 2 * 100 + 14 * 100 / 4), (3, 16 * 100 / 4)],
)
def test_each_stage_formula(stage: int, expected: float) -> None:
    assert zero_paper_bytes(stage, 100, 4) == expected


def test_engine_formula_for_fp32_adam_matches_zero_for_every_stage() -> None:
    for stage in (1, 2, 3):
        state = engine_bytes(
            stage, 1000, 4, param_bytes=4, compute_bytes=4, reduce_bytes=4,
            optimizer_bytes_per_param=8,
        )  # fmt: skip
        assert state.total == zero_paper_bytes(stage, 1000, 4, param_bytes=4, grad_bytes=4, k=8)
    # With a 16-bit reduction, stage 1 keeps the fp32 gradient shard beside the whole gradient.
    state = engine_bytes(
        1, 1000, 4, param_bytes=2, compute_bytes=2, reduce_bytes=2, optimizer_bytes_per_param=8
    )
    expected = zero_paper_bytes(1, 1000, 4, param_bytes=2, grad_bytes=2, k=8)
    assert state.total == expected + 4 * 1000 / 4 + state.master


def test_recommendation_follows_the_documented_order() -> None:
    spec = ModelSpec(num_params=10**9, largest_tensor_numel=10**7)
    roomy = plan(spec, world_size=8, device_memory_bytes=10**12, host_memory_bytes=10**12)
    assert roomy.recommended is not None and roomy.recommended.stage == 0
    tight = plan(spec, world_size=8, device_memory_bytes=4 * 10**9, host_memory_bytes=10**12)
    assert tight.recommended is not None
    assert (tight.recommended.stage, tight.recommended.placement) == (3, "cuda")
    tiny = plan(spec, world_size=8, device_memory_bytes=5 * 10**8, host_memory_bytes=10**12)
    assert tiny.recommended is not None and tiny.recommended.placement in ("auto", "cpu")
    none = plan(spec, world_size=8, device_memory_bytes=10**6, host_memory_bytes=10**6)
    assert none.recommended is None


def test_module_spec_counts_tied_weights_once() -> None:
    embedding = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    spec = ModelSpec.from_module(torch.nn.Sequential(embedding, head))
    assert spec.num_params == 40 and spec.tensor_numels == (40,)


def test_command_line_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--params", "7.5e9", "--world-size", "64", "--device-memory", "32GB",
            "--host-memory", "1TB", "--dtype", "fp16", "--json"]  # fmt: skip
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["zero_stage"] == 2
    papers = [round(o["zero_paper_bytes"] / 1e9, 1) for o in result["options"]]
    assert papers[:3] == [120.0, 16.6, 31.4]
    with pytest.raises(SystemExit):
        main(["plan", "--params", "1e9", "--world-size", "2", "--device-memory", "lots",
              "--host-memory", "1TB"])  # fmt: skip


def test_smallest_budget_is_the_gathered_chunks_and_activations() -> None:
    spec = ModelSpec(num_params=10_000_000, largest_tensor_numel=1_000)
    result = plan(
        spec, world_size=4, device_memory_bytes=10**12, host_memory_bytes=10**12,
        param_dtype=torch.float16, compute_dtype=torch.float32, chunk_size_numel=500_000,
        activation_bytes=123,
    )  # fmt: skip
    # Two chunks gathered at once, each in fp16 (payload), fp32 (compute) and fp16 (reduce).
    assert result.smallest_budget_bytes == 2 * 500_000 * (2 + 4 + 2) + 123
    assert "smallest device budget" in result.table()


def test_command_line_detects_this_machines_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "1e8", "--world-size", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["smallest_budget_bytes"]["auto"] == result["smallest_budget_bytes"]["cpu"] > 0
    assert main(["plan", "--params", "1e8", "--world-size", "2"]) == 0
    assert "planning with this" in capsys.readouterr().out


def test_hybrid_sharding_shards_over_the_group_and_sends_one_shard_across() -> None:
    spec = ModelSpec(num_params=8_000_000, largest_tensor_numel=1_000)
    common = {"device_memory_bytes": 10**12, "host_memory_bytes": 10**12}
    full = plan(spec, world_size=16, chunk_size_numel=1_000_000, **common)
    hybrid = plan(spec, world_size=16, chunk_size_numel=1_000_000, shard_size=8, **common)
    by_name = {option.name: option for option in hybrid.options}
    # Memory as if the 8 ranks of a group were the whole world.
    within = plan(spec, world_size=8, chunk_size_numel=1_000_000, **common)
    for option in within.options[1:]:
        assert by_name[option.name].device == option.device, option.name
    # Across groups, per rank and step: 2 (R - 1) / R of the fp32 gradient shard, R = 2.
    stage3 = by_name["stage 3 (cuda)"]
    assert stage3.cross_group_bytes_per_step == 4 * hybrid.psi_padded / 8
    assert all(option.cross_group_bytes_per_step == 0 for option in full.options)
    assert by_name["DDP"].cross_group_bytes_per_step == 0
    assert "across groups" in hybrid.table()
    # Where DDP does not fit, the recommended wrapper call carries the group size.
    tight = plan(
        spec, world_size=16, shard_size=8, device_memory_bytes=100_000_000,
        host_memory_bytes=10**12,
    )  # fmt: skip
    assert tight.zero_stage in (1, 2, 3)
    assert tight.gemini_config["shard_size"] == 8
    assert "'shard_size': 8" in tight.wrapper_call()
    with pytest.raises(ValueError, match="shard_size must be a positive int dividing"):
        plan(spec, world_size=16, shard_size=3, **common)


def test_hpz_moves_backward_gathers_into_the_node_and_holds_a_slice_of_every_chunk() -> None:
    spec = ModelSpec(num_params=8_000_000, largest_tensor_numel=1_000)
    common = {"device_memory_bytes": 10**12, "host_memory_bytes": 10**12}
    full = plan(spec, world_size=16, chunk_size_numel=1_000_000, **common)
    hpz = plan(spec, world_size=16, chunk_size_numel=1_000_000, secondary_shard_size=8, **common)
    before, after = full.options[-1], hpz.options[-1]  # stage 3, the same placement
    assert after.stage == 3 and before.name == after.name
    # Backward's fp32 gathers: 7/8 of the parameters inside the node instead of 15/16 over all.
    assert after.in_node_bytes_per_step == 4 * 7 / 8 * spec.num_params
    assert after.comm_bytes_per_step == pytest.approx(
        before.comm_bytes_per_step - 4 * 15 / 16 * spec.num_params + 4 * 7 / 8 * spec.num_params
    )
    # Memory: an eighth of every chunk's fp32 payload, from forward to backward.
    assert after.working_bytes == before.working_bytes + 4 * hpz.psi_padded / 8
    assert all(o.in_node_bytes_per_step == 0 for o in hpz.options if o.stage < 3)
    assert "in node (hpZ)" in hpz.table()
    assert hpz.recommended is not None and hpz.recommended.stage == 0  # DDP fits here
    # Where only stage 3 fits, the recommended wrapper call carries the group size.
    tight = plan(
        spec, world_size=16, secondary_shard_size=8, chunk_size_numel=1_000_000,
        device_memory_bytes=38_000_000, host_memory_bytes=10**12,
    )  # fmt: skip
    assert tight.zero_stage == 3
    assert tight.gemini_config["secondary_shard_size"] == 8
    assert "'secondary_shard_size': 8" in tight.wrapper_call()
    for bad, message in ((3, "dividing"), (16, "smaller"), (0, "positive")):
        with pytest.raises(ValueError, match=message):
            plan(spec, world_size=16, secondary_shard_size=bad, **common)
    with pytest.raises(ValueError, match="cannot be combined"):
        plan(spec, world_size=16, secondary_shard_size=8, shard_size=8, **common)
