"""ShardwiseCallback in a real transformers.Trainer on 2 CPU ranks (gloo), started as torchrun
starts them.

One run of tests/hf/trainer_run.py trains tiny Llama and GPT-2 models from configs with a plain
Trainer and with the callback (stage 3, and Llama at stages 1 and 2), evaluating during and
after training, saves, resumes, loads the best checkpoint, trains with activation checkpointing
(reentrant and not, plain and at stages 1-3), trains a Switch Transformers model whose ranks
route tokens to different experts, trains with hybrid sharding and with int8 wire formats,
accumulates 3 micro-batches per step unclipped at stages 1-3, and builds a conflicting set-up
and a Trainer that does not run distributed; the tests below assert on what it wrote. Loading
the saved models happens in a plain process without shardwise (tests/hf/load_plain.py).

Its ranks are forked from this process, torchrun's environment set (tests/forked_script.py):
torchrun would start each rank afresh, importing torch and transformers again, which costs
tens of seconds on a loaded 2-core machine. The example's test (tests/hf/test_example.py)
still launches the callback under torchrun itself.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from forked_script import run_script

import shardwise_hf  # noqa: F401  (imported before the forks, as the docstring says)

# transformers imports its model classes lazily: once here, not in every rank.
_ = (transformers.Trainer, transformers.LlamaForCausalLM, transformers.GPT2LMHeadModel)
_ = transformers.SwitchTransformersForConditionalGeneration

HERE = Path(__file__).resolve().parent


KINDS = ("llama", "gpt2")
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "0"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf_trainer")
    logs = tmp_path_factory.mktemp("hf_trainer_logs")
    outputs = run_script(HERE / "trainer_run.py", str(out), out=logs, timeout_s=240, env=ENV)
    for rank, output in enumerate(outputs):
        assert output.exit_code == 0, (rank, output.stdout[-2000:] + output.stderr[-4000:])
    return out


@pytest.fixture(scope="module")
def seen(run_dir: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((run_dir / "seen.json").read_text())
    return loaded


@pytest.mark.parametrize("kind", KINDS)
def test_loss_matches_the_plain_trainer(seen: dict[str, Any], kind: str) -> None:
    # [Note: tolerance] fp32 throughout. A step whose gradient norm exceeds max_grad_norm is
    # clipped by a coefficient computed from a norm summed in another order (per shard over
    # ranks, against torch's per-tensor norms), which differs in the last bits; losses after
    # such a step agree to ~1e-7 relative. Steps without clipping are bit-identical.
    run = seen[kind]
    assert len(run["loss"]) == len(run["plain_loss"]) == 6
    assert run["loss"][0] == run["plain_loss"][0]
    for mine, plain in zip(run["loss"], run["plain_loss"], strict=True):
        assert math.isclose(mine, plain, rel_tol=1e-5), (run["loss"], run["plain_loss"])
    # The logged norm is the engine's (over every rank's shards), not the Trainer's empty one.
    for mine, plain in zip(run["grad_norm"], run["plain_grad_norm"], strict=True):
        assert math.isclose(mine, plain, rel_tol=1e-5), (run["grad_norm"], run["plain_grad_norm"])
    assert run["loss"][-1] < run["loss"][0]


def test_unclipped_llama_run_is_bit_identical(seen: dict[str, Any]) -> None:
    run = seen["llama"]
    clipped = [i for i, norm in enumerate(run["plain_grad_norm"]) if norm > 1.0]
    first = clipped[0] if clipped else len(run["loss"])
    # Up to and including the first clipped step, the losses are computed before any
    # clipping difference can reach the weights.
    assert run["loss"][: first + 1] == run["plain_loss"][: first + 1]


@pytest.mark.parametrize("kind", KINDS)
def test_model_state_is_one_half_per_rank(seen: dict[str, Any], kind: str) -> None:
    run = seen[kind]
    whole_bytes = run["numel"] * 4  # fp32
    ranks = run["bytes_per_rank"]
    assert len(ranks) == 2
    for held in ranks:
        # Chunks are padded to a multiple of the world size: at most a few elements more.
        assert whole_bytes / 2 <= held["params"] <= whole_bytes / 2 + 64, held
        assert whole_bytes / 2 <= held["grads"] <= whole_bytes / 2 + 64, held
        assert whole_bytes <= held["optimizer"] <= whole_bytes + 128, held  # Adam: 2 moments
    assert run["loss_scale"] == [1.0] * 6  # fp32: constant scale, logged through the Trainer
    assert run["model_state_bytes_logged"][-1] == ranks[0]["params"] + ranks[0]["grads"]


@pytest.mark.parametrize("kind", KINDS)
def test_evaluation_matches_the_plain_trainer(seen: dict[str, Any], kind: str) -> None:
    # Same tolerance as the training loss (see [Note: tolerance]): evaluation computes exactly
    # as the plain Trainer does on the same weights, which differ in the last bits after a
    # clipped step.
    run = seen[kind]
    # Before training both models hold the same weights: the evaluation itself adds nothing.
    assert run["eval_before"] == run["plain_eval_before"]
    assert [step for step, _ in run["eval_loss"]] == [3, 6]
    assert [step for step, _ in run["plain_eval_loss"]] == [3, 6]
    pairs = [
        *zip([e for _, e in run["eval_loss"]], [e for _, e in run["plain_eval_loss"]], strict=True),
        (run["eval_after"], run["plain_eval_after"]),
        (run["predict_loss"], run["plain_predict_loss"]),
    ]
    for mine, plain in pairs:
        assert math.isclose(mine, plain, rel_tol=1e-5), pairs
    # predict() returns every held-out sample's logits, gathered from both ranks.
    assert run["predict_shape"] == [12, 16, 96]
    assert run["predict_max_diff"] < 1e-5
    # The Trainer shards the evaluation data: each rank ran 3 batches of 2 of the 12 samples
    # per evaluation (5 with the callback: before, steps 3 and 6, after, predict; 4 without).
    assert run["eval_batches"] == [[15, 12], [15, 12]]
    # Evaluation left the user's model as it was (accelerate did not wrap its forward).
    assert run["forward_replaced"] is False


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unclipped_evaluation_is_bit_identical(seen: dict[str, Any], stage: int) -> None:
    # Llama's first clipped step is step 4, so the step-3 evaluation sees the plain Trainer's
    # weights exactly at every stage: each accumulates the two micro-batches' gradients
    # locally (under no_sync) before reducing them, as DDP does.
    plain = seen["llama"]
    assert all(norm <= 1.0 for norm in plain["plain_grad_norm"][:3])
    run = plain if stage == 3 else seen["lower_stages"][f"stage{stage}"]
    assert run["eval_loss"][0] == plain["plain_eval_loss"][0]


@pytest.mark.parametrize("stage", [1, 2, 3, "3early"])
def test_unclipped_accumulation_is_bit_identical(seen: dict[str, Any], stage: int | str) -> None:
    # 3 micro-batches per step, the epoch ending on a step of 1 (the Trainer syncs there
    # too): every micro-batch but a step's last runs under the model's no_sync(), so each rank
    # sums its gradients as DDP does and the last backward reduces the sum once. fp32 and
    # unclipped: every loss and every final weight equals the plain Trainer's.
    runs = seen["accumulation"]
    plain = runs["plain"]
    assert len(plain["loss"]) == 6
    run = runs[f"stage{stage}"]
    assert run["loss"] == plain["loss"], (run, plain)
    assert run["max_weight_diff"] == 0.0, run
    if stage == "3early":  # chunks stepped during each step's last backward
        counts = runs["stepped_in_backward"]
        assert len(counts) == 6 and all(count > 0 for count in counts), counts


def test_evaluation_leaves_nothing_behind(seen: dict[str, Any]) -> None:
    # After every evaluation (each rank): no chunk left gathered, no gradient in the chunks,
    # no parameter with a .grad (the Trainer evaluates under torch.no_grad).
    afters = [seen[kind]["after_eval"] for kind in KINDS] + [
        seen["lower_stages"][stage]["after_eval"] for stage in ("stage1", "stage2")
    ]
    for ranks in afters:
        assert len(ranks) == 2
        for evaluations in ranks:
            assert len(evaluations) >= 3
            assert all(
                e == {"gathered": 0, "grad_elements": 0, "param_grads": 0} for e in evaluations
            )


def test_evaluating_does_not_change_training(seen: dict[str, Any]) -> None:
    # bf16 TrainingArguments turn on accelerate's autocast, which the Trainer's evaluation
    # would wrap around the model's forward (and so around every later training step).
    runs = seen["bf16"]
    assert [step for step, _ in runs["evaluating"]["eval_loss"]] == [3, 6]
    assert runs["evaluating"]["loss"] == runs["not_evaluating"]["loss"]
    assert runs["evaluating"]["forward_replaced"] is False


@pytest.mark.parametrize("stage", [1, 2])
def test_lower_stages_match_the_plain_trainer(seen: dict[str, Any], stage: int) -> None:
    run, plain = seen["lower_stages"][f"stage{stage}"], seen["llama"]
    for mine, ref in (
        *zip(run["loss"], plain["plain_loss"], strict=True),
        *zip(run["grad_norm"], plain["plain_grad_norm"], strict=True),
        *zip(
            [e for _, e in run["eval_loss"]], [e for _, e in plain["plain_eval_loss"]], strict=True
        ),
    ):
        assert math.isclose(mine, ref, rel_tol=1e-5), (run, plain)  # see [Note: tolerance]
    assert run["loss"][:4] == plain["plain_loss"][:4]  # up to the first clipped step
    whole_bytes = plain["numel"] * 4  # fp32
    for held in run["bytes_per_rank"]:
        # Adam's two moments, one half per rank: optimizer state is sharded at both stages.
        assert whole_bytes <= held["optimizer"] <= whole_bytes + 128, held
        assert held["params"] == whole_bytes, held  # parameters stay whole below stage 3
        if stage == 2:
            assert whole_bytes / 2 <= held["grads"] <= whole_bytes / 2 + 64, held
        else:
            # The whole gradient, whose own half receives the reduced gradient at the step.
            assert whole_bytes <= held["grads"] <= whole_bytes + 64, held


@pytest.mark.parametrize("stage", [1, 2])
def test_best_checkpoint_is_loaded_at_the_end(seen: dict[str, Any], stage: int) -> None:
    run = seen["lower_stages"][f"stage{stage}"]
    (_, at_3), (_, at_6) = run["eval_loss"]
    assert at_3 < at_6 and run["best_global_step"] == 3
    # save_strategy="steps" keeps both checkpoints, "best" (stage 2) only the best one.
    expected = ["checkpoint-3", "checkpoint-6"] if stage == 1 else ["checkpoint-3"]
    assert run["checkpoints"] == expected
    # The weights of step 3 are back: evaluating them again gives step 3's loss exactly.
    assert run["eval_after_load_best"] == at_3


@pytest.mark.parametrize("kind", KINDS)
def test_resume_continues_exactly(seen: dict[str, Any], run_dir: Path, kind: str) -> None:
    run = seen[kind]
    state = json.loads(
        (run_dir / kind / "sharded" / "checkpoint-3" / "trainer_state.json").read_text()
    )
    assert len([e for e in state["log_history"] if "loss" in e]) == 3
    assert (run_dir / kind / "sharded" / "checkpoint-3" / "shardwise" / "manifest.json").is_file()
    assert run["resumed_loss"][3:] == run["loss"][3:]  # steps 4-6, trained after the resume
    assert run["resumed_eval_loss"] == run["eval_loss"]
    assert run["resumed_logits_equal"], run["resumed_logits_max_diff"]


def test_saved_model_loads_without_shardwise(run_dir: Path) -> None:
    for kind in KINDS:
        final = run_dir / kind / "final"
        assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()
        split = run_dir / kind / "final_split"
        index = json.loads((split / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    result = subprocess.run(
        [sys.executable, str(HERE / "load_plain.py"), str(run_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **ENV},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found.pop("shardwise_imported") is False
    assert sorted(found) == [f"{k}/{n}" for k in sorted(KINDS) for n in ("final", "final_split")]
    # The saved weights are the fp32 masters the engine computes with: identical logits.
    assert all(diff == 0.0 for diff in found.values()), found


def test_conflicting_settings_reported_together(seen: dict[str, Any]) -> None:
    message = seen["conflict_error"]
    assert "4 problems" in message
    assert "chunk size must be at least 1 element, got 0" in message  # the engine's refusal
    assert "precision='fp16' but TrainingArguments ask for bf16" in message
    assert "auto_find_batch_size=True" in message
    assert "restore_callback_states_from_checkpoint=True" in message


def test_fp16_loss_scale_skips_steps_and_the_scheduler(seen: dict[str, Any]) -> None:
    flooded = seen["fp16"]["overflowing"]
    # Every step overflows: the update and the LR scheduler step are both skipped (the
    # warm-up learning rate stays 0), and the scale halves each time (hysteresis=1).
    assert flooded["overflows"] == 6
    assert flooded["learning_rate"] == [0.0] * 6
    assert flooded["loss_scale"] == [2.0**39 / 2**i for i in range(6)]
    normal = seen["fp16"]["default"]
    assert normal["overflows"] == 0 and normal["loss_scale"] == [2.0**16] * 6
    # fp16 storage of fp32-computed weights: close to the fp32 run, and learning.
    plain = seen["llama"]["plain_loss"]
    assert all(math.isclose(a, b, rel_tol=2e-3) for a, b in zip(normal["loss"], plain, strict=True))
    assert normal["loss"][-1] < normal["loss"][0]


@pytest.mark.parametrize("kind", ["non_reentrant", "reentrant"])
def test_gradient_checkpointing_matches_the_plain_trainer(seen: dict[str, Any], kind: str) -> None:
    # gradient_checkpointing=True with use_reentrant False and True, at stages 1-3, against the
    # plain Trainer with the same setting. Recomputing a layer gives the same fp32 numbers as
    # its first forward, so the tolerance is the one of the runs without checkpointing (see
    # [Note: tolerance]): bit-identical up to the first clipped step, 1e-5 relative after.
    runs = seen["checkpointing"]
    plain = runs[f"{kind}_plain"]
    # Checkpointing changes no number of the plain Trainer either.
    assert plain["loss"] == seen["llama"]["plain_loss"]
    clipped = [i for i, norm in enumerate(plain["grad_norm"]) if norm > 1.0]
    first = clipped[0] if clipped else len(plain["loss"])
    for stage in (1, 2, 3):
        run = runs[f"{kind}_{stage}"]
        assert run["checkpointing"] and plain["checkpointing"]
        assert run["loss"][: first + 1] == plain["loss"][: first + 1], (stage, run, plain)
        for mine, ref in (
            *zip(run["loss"], plain["loss"], strict=True),
            *zip(run["grad_norm"], plain["grad_norm"], strict=True),
        ):
            assert math.isclose(mine, ref, rel_tol=1e-5), (stage, run, plain)
        # 6 steps of 2 micro-batches: 12 passes of the model, and the projection inside the
        # checkpointed layer ran 24 times (its recomputation in backward included) ...
        assert run["layer_calls"] == plain["layer_calls"] == 24, (stage, run)
        # ... while the recomputation is no new pass of the model (the engine's pass
        # counters, checked across ranks at stage 3, count root forwards).
        assert run["root_calls"] == plain["root_calls"] == 12, (stage, run)


def test_switch_transformers_trains_at_stage_3_as_the_plain_trainer(seen: dict[str, Any]) -> None:
    # The ranks route tokens to different experts (an expert called on one rank and not on
    # the other in some pass), which once hung stage 3. Unclipped fp32 with 2 ranks: each
    # averaged gradient element is (a + b) / 2 in both runs, so the losses agree bit for bit.
    runs = seen["switch"]
    plain, sharded = runs["plain"], runs["stage3"]
    passes = len(plain["calls"][0])
    assert passes == 12
    assert any(set(plain["calls"][0][i]) != set(plain["calls"][1][i]) for i in range(passes))
    assert sharded["calls"] == plain["calls"]
    assert len(sharded["loss"]) == 6
    assert sharded["loss"] == plain["loss"]


def test_hybrid_sharding_through_the_callback_matches_the_plain_trainer(
    seen: dict[str, Any],
) -> None:
    # shard_size=1 on 2 ranks: two replicas, each rank's gradient shard (the whole gradient)
    # all-reduced across them, (a + b) / 2 as DDP computes it: unclipped, bit for bit.
    runs = seen["hybrid"]
    assert len(runs["plain"]["loss"]) == 6
    for stage in ("stage2", "stage3"):
        assert runs[stage]["replicas"] == 2
        assert runs[stage]["loss"] == runs["plain"]["loss"], (stage, runs)


def test_quantized_wire_formats_through_the_callback_train_close_to_the_plain_trainer(
    seen: dict[str, Any],
) -> None:
    # int8 moves each value another rank sends by at most 1/254 of its block's largest
    # magnitude (tests/test_wire_formats.py states the bound): 6 steps stay within 1% of the
    # plain Trainer's losses, and differ from them (the formats were in use).
    plain = seen["hybrid"]["plain"]["loss"]  # the same arguments, unclipped
    for stage in ("stage2", "stage3"):
        run = seen["wire"][stage]
        assert run["communication"] == ["int8", "int8", 64], stage
        assert run["wires"] == ["QuantizedGather+QuantizedReduce"], stage
        assert len(run["loss"]) == len(plain) == 6
        for mine, theirs in zip(run["loss"], plain, strict=True):
            assert math.isclose(mine, theirs, rel_tol=1e-2), (stage, run["loss"], plain)
        assert run["loss"] != plain, stage
        # One byte a value and an fp32 scale per 64 against fp32's 4 bytes a value (what the
        # engine says the same collectives would have sent unquantized).
        for op in ("all_gather", "reduce_scatter"):
            count = run["comm"][op]
            ratio = count["sent_bytes"] / count["unquantized_sent_bytes"]
            assert ratio == pytest.approx((1 + 4 / 64) / 4, abs=0.01), (stage, op, ratio)


def test_torch_compile_through_the_callback_matches_the_compiled_plain_trainer(
    seen: dict[str, Any],
) -> None:
    runs = seen["compiled"]
    assert len(runs["plain"]["loss"]) == 6
    for stage in ("stage2", "stage3"):
        assert runs[stage]["loss"] == runs["plain"]["loss"], (stage, runs)
        assert runs[stage]["compiled_late"] == 0, (stage, runs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the Trainer runs distributed")
def test_a_trainer_that_is_not_distributed_is_refused(seen: dict[str, Any]) -> None:
    message = seen["not_distributed"]
    assert "the Trainer does not run distributed" in message, message
    assert "world_size=1" in message and "process group has 2 ranks" in message
    assert "use_cpu=True" in message
