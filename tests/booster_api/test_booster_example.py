"""examples/booster_gpt.py, a script written as ColossalAI's GPT example is: under torchrun, as a
user launches it, and, for the save and the resume, on 2 ranks forked from this process with
torchrun's environment (tests/forked_script.py), which spares torchrun's start-up (a fresh
interpreter importing torch per rank) on the two runs that test the checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

from forked_script import run_script
from launch import torchrun

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLE = ROOT / "examples" / "booster_gpt.py"


def _check_it_learns(stdout: str) -> float:
    """The run's last loss, once checked that the run learnt."""
    found = re.search(r"first loss ([\d.]+), last loss ([\d.]+)", stdout)
    assert found is not None, stdout[-2000:]
    first, last = float(found[1]), float(found[2])
    assert first > 4.5  # about ln 128 at the start
    assert last < first - 0.5  # the counting pattern is being learnt
    return last


def test_the_booster_example_trains_with_low_level_zero() -> None:
    done = torchrun(EXAMPLE, "--plugin", "low_level_zero", "--steps", "12")
    assert done.returncode == 0, done.stderr[-3000:]
    _check_it_learns(done.stdout)


def test_the_booster_example_trains_with_gemini_and_resumes_with_low_level_zero(
    tmp_path: Path,
) -> None:
    checkpoint = str(tmp_path / "saved")
    saved = run_script(
        EXAMPLE, "--plugin", "gemini", "--steps", "12", "--save-dir", checkpoint,
        out=tmp_path / "save_logs", env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert [rank.exit_code for rank in saved] == [0, 0], saved[0].stderr[-3000:]
    last = _check_it_learns(saved[0].stdout)
    resumed = run_script(
        EXAMPLE, "--plugin", "low_level_zero", "--steps", "4", "--load-dir", checkpoint,
        out=tmp_path / "resume_logs", env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert [rank.exit_code for rank in resumed] == [0, 0], resumed[0].stderr[-3000:]
    after = re.search(r"first loss ([\d.]+)", resumed[0].stdout)
    assert after is not None, resumed[0].stdout[-2000:]
    # The resumed run starts where the saved one ended, far below a fresh model's ln 128.
    assert float(after[1]) < last + 0.3 < 4.5
