"""examples/hf_trainer.py under torchrun, as a user launches it."""

from __future__ import annotations

import ast
from pathlib import Path

from launch import torchrun

ROOT = Path(__file__).resolve().parents[2]


def test_example_trains_and_saves(tmp_path: Path) -> None:
    script = ROOT / "examples" / "hf_trainer.py"
    result = torchrun(script, "--steps", "10", "--out", str(tmp_path), env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    losses = [
        float(ast.literal_eval(line)["loss"])
        for line in result.stdout.splitlines()
        if line.startswith("{'loss'")
    ]
    assert len(losses) == 2  # logging_steps=5 over 10 steps, printed by rank 0
    evaluations = [
        float(ast.literal_eval(line)["eval_loss"])
        for line in result.stdout.splitlines()
        if line.startswith("{'eval_loss'")
    ]
    assert len(evaluations) == 3  # eval_steps=5 over 10 steps, then trainer.evaluate()
    assert evaluations[-1] == evaluations[-2]  # the same weights evaluated twice
    assert "loss_scale" in result.stdout and "model_state_bytes" in result.stdout
    assert (tmp_path / "final" / "config.json").is_file()
    assert (tmp_path / "final" / "model.safetensors").is_file()
