"""examples/booster_gpt.py, a script written as ColossalAI's GPT example is, under torchrun."""

from __future__ import annotations

import re
from pathlib import Path

from launch import torchrun

ROOT = Path(__file__).resolve().parent.parent.parent


def _check_it_learns(stdout: str) -> float:
    """The run's last loss, once checked that the run learnt."""
    found = re.search(r"first loss ([\d.]+), last loss ([\d.]+)", stdout)
    assert found is not None, stdout[-2000:]
    first, last = float(found[1]), float(found[2])
    assert first > 4.5  # about ln 128 at the start
    assert last < first - 0.5  # the counting pattern is being learnt
    return last


def test_the_booster_example_trains_with_low_level_zero() -> None:
    done = torchrun(
        ROOT / "examples" / "booster_gpt.py", "--plugin", "low_level_zero", "--steps", "12"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _check_it_learns(done.stdout)


def test_the_booster_example_trains_with_gemini_and_resumes_with_low_level_zero(
    tmp_path: Path,
) -> None:
    saved = torchrun(
        ROOT / "examples" / "booster_gpt.py",
        "--plugin",
        "gemini",
        "--steps",
        "12",
        "--save-dir",
        str(tmp_path),
    )
    assert saved.returncode == 0, saved.stderr[-3000:]
    last = _check_it_learns(saved.stdout)
    resumed = torchrun(
        ROOT / "examples" / "booster_gpt.py",
        "--plugin",
        "low_level_zero",
        "--steps",
        "4",
        "--load-dir",
        str(tmp_path),
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = re.search(r"first loss ([\d.]+)", resumed.stdout)
    assert after is not None, resumed.stdout[-2000:]
    # The resumed run starts where the saved one ended, far below a fresh model's ln 128.
    assert float(after[1]) < last + 0.3 < 4.5
