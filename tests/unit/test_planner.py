"""The planner's formulas, the ZeRO paper's Figure 1, and the command line."""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.cli import main
from shardwise.comm.quantize import BlockQuantizer
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


def test_auto_fits_wherever_its_device_part_is_the_whole_room() -> None:
    # A 9.9B-parameter GPT (48 layers of width 4096) on one 139 GiB GPU at 90%: "auto" keeps
    # on the device exactly what fits, and the sum of that share and the working set came to a
    # rounding above the device's memory, so the plan read "nothing fits" where the 10.7B GPT
    # (52 layers) fit.
    from shardwise.testing import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(
            GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=32, n_embd=4096)
        )
    advice = plan(
        model, world_size=1, device_memory_bytes=int(139 * 2**30 * 0.9),
        host_memory_bytes=125 * 2**30, compute_dtype=torch.bfloat16,
        reduce_dtype=torch.float32, optimizer="hybridadam",
        chunk_size_numel=32 * 2**20,
    )  # fmt: skip
    auto = next(o for o in advice.options if o.placement == "auto")
    assert auto.host.total > 0 and auto.fits, auto
    assert advice.recommended is auto


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
    assert papers[:3] == [120.0, 31.4, 16.6]  # DDP, stage 1, stage 2: the paper's order
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


def test_quantized_formats_count_their_buffers_and_send_their_records(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """See [Note: wire buffers in the plan]: int8 gathers and int4 reductions hold their
    records (and a reduction its two fp32 slices) beside the chunks, one gather and one
    reduction in flight at stage 3, every chunk's gather and two reductions at stages 1-2; the
    model state is as without them, and the traffic is the records'."""
    spec = ModelSpec(num_params=8_000_000, largest_tensor_numel=1_000)
    common = {"device_memory_bytes": 10**12, "host_memory_bytes": 10**12}
    off = plan(spec, world_size=8, chunk_size_numel=1_000_000, **common)
    on = plan(
        spec, world_size=8, chunk_size_numel=1_000_000, gather_format="int8",
        reduce_format="int4", **common,
    )  # fmt: skip
    before = {option.name: option for option in off.options}
    after = {option.name: option for option in on.options}
    assert "DDP" in before and "DDP" not in after  # ColoDDP takes no wire format
    shard = 1_000_000 // 8
    int8, int4 = BlockQuantizer("int8", 256), BlockQuantizer("int4", 256)
    gather = 9 * int8.record_nbytes(shard)  # this rank's record and the 8 it receives
    reduction = 2 * 7 * int4.record_nbytes(shard) + 2 * 4 * shard  # 7 sent, 7 received
    assert int4.record_nbytes(shard) == shard // 2 + 4 * 489  # half a byte a value, scales
    stage3, stage2 = after["stage 3 (cuda)"], after["stage 2 (cuda)"]
    assert stage3.working_bytes == before["stage 3 (cuda)"].working_bytes + gather + reduction
    gathers = -(-gather * on.psi_padded // 1_000_000)  # every chunk's at once after the step
    assert stage2.working_bytes == before["stage 2 (cuda)"].working_bytes + gathers + 2 * reduction
    assert on.smallest_budget_bytes == off.smallest_budget_bytes + gather + reduction
    for name, option in after.items():
        assert option.device == before[name].device and option.host == before[name].host, name
    # Traffic: int8 records for fp32 parameters, int4 records for fp32 gradients.
    per_element = int4.record_nbytes(shard) / shard + int8.record_nbytes(shard) / shard
    assert stage2.comm_bytes_per_step == pytest.approx(per_element * 7 / 8 * spec.num_params)
    assert stage2.comm_bytes_per_step / before["stage 2 (cuda)"].comm_bytes_per_step == (
        pytest.approx((0.5 + 1 + 8 / 256) / 8, abs=1e-4)  # the last block of a shard is short
    )
    # The recommendation carries the formats into gemini_config.
    assert on.zero_stage == 2 and on.gemini_config == {
        "gather_format": "int8",
        "reduce_format": "int4",
    }
    assert "'reduce_format': 'int4'" in on.wrapper_call()
    tight = plan(
        spec, world_size=8, device_memory_bytes=30_000_000, host_memory_bytes=10**12,
        chunk_size_numel=1_000_000, reduce_format="int4", quant_block_numel=64,
    )  # fmt: skip
    assert tight.zero_stage == 3
    assert tight.gemini_config["reduce_format"] == "int4"
    assert tight.gemini_config["quant_block_numel"] == 64
    # Hybrid sharding: across the groups a reduce-scatter of records and an exact all-gather.
    hybrid = plan(spec, world_size=16, shard_size=8, reduce_format="int4", **common)
    across = next(o.cross_group_bytes_per_step for o in hybrid.options if o.stage == 3)
    shard_across = -(-(hybrid.psi_padded // 8) // 2)
    records = int4.record_nbytes(shard_across) / shard_across
    assert across == pytest.approx(0.5 * (records + 4) * hybrid.psi_padded / 8)
    with pytest.raises(ValueError, match="gather_format='int4' is not offered"):
        plan(spec, world_size=8, gather_format="int4", **common)
    with pytest.raises(ValueError, match="reduce_format must be one of"):
        plan(spec, world_size=8, reduce_format="int2", **common)
    args = ["plan", "--params", "8e6", "--world-size", "8", "--device-memory", "1TB",
            "--host-memory", "1TB", "--reduce-format", "int4", "--json"]  # fmt: skip
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["gemini_config"] == {"reduce_format": "int4"}
