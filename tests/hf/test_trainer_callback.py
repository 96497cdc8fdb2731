"""ShardwiseCallback in a real transformers.Trainer under torchrun (2 CPU ranks, gloo).

One torchrun launch (tests/hf/trainer_run.py) trains tiny Llama and GPT-2 models from configs
with a plain Trainer and with the callback, saves, resumes and builds a conflicting set-up; the
tests below assert on what it wrote. Loading the saved models happens in a plain process
without shardwise (tests/hf/load_plain.py).
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

HERE = Path(__file__).resolve().parent
KINDS = ("llama", "gpt2")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "0"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf_trainer")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(HERE / "trainer_run.py"),
            str(out),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
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
def test_resume_continues_exactly(seen: dict[str, Any], run_dir: Path, kind: str) -> None:
    run = seen[kind]
    state = json.loads(
        (run_dir / kind / "sharded" / "checkpoint-3" / "trainer_state.json").read_text()
    )
    assert len([e for e in state["log_history"] if "loss" in e]) == 3
    assert (run_dir / kind / "sharded" / "checkpoint-3" / "shardwise" / "manifest.json").is_file()
    assert run["resumed_loss"][3:] == run["loss"][3:]  # steps 4-6, trained after the resume
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
        env=ENV,
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
    assert "chunk_size must be a positive number of elements or None, got 0" in message
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
