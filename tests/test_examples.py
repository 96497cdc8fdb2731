"""End to end: the demo script under torchrun, as a user launches it."""

from __future__ import annotations

import re
from pathlib import Path

from launch import torchrun

ROOT = Path(__file__).resolve().parent.parent


def test_demo_trains_under_torchrun() -> None:
    result = torchrun(ROOT / "examples" / "train_gpt.py", "--steps", "40")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(r"step +(\d+) \| loss ([\d.]+) \| scale +(\d+)", result.stdout)
    assert [int(step) for step, _, _ in lines] == list(range(40))
    losses = [float(loss) for _, loss, _ in lines]
    assert losses[-1] < losses[0] / 2
    assert "ZeRO stage 3 on 2 ranks" in result.stdout
