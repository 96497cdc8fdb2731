"""examples/booster_gpt.py, a script written as ColossalAI's GPT example is, under torchrun."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launch import torchrun

ROOT = Path(__file__).resolve().parent.parent.parent


@pytest.mark.parametrize("plugin", ["gemini", "low_level_zero"])
def test_the_booster_example_trains(plugin: str) -> None:
    done = torchrun(ROOT / "examples" / "booster_gpt.py", "--plugin", plugin, "--steps", "12")
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"first loss ([\d.]+), last loss ([\d.]+)", done.stdout)
    assert found is not None, done.stdout[-2000:]
    first, last = float(found[1]), float(found[2])
    assert first > 4.5  # about ln 128 at the start
    assert last < first - 0.5  # the counting pattern is being learnt
