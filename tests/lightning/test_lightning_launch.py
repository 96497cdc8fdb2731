"""End to end: the Lightning example as a user launches it, under torchrun and under
Lightning's own launcher (which starts the second process by re-running the script)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_gemini.py"
STEPS = 30


def _run(command: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=240, check=False, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.parametrize(
    "launcher",
    [
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
        [sys.executable],
    ],
    ids=["torchrun", "lightning_popen"],
)
def test_example_trains_on_two_ranks(launcher: list[str]) -> None:
    extra = [] if "torch.distributed.run" in launcher else ["--devices", "2"]
    stdout = _run([*launcher, str(EXAMPLE), "--steps", str(STEPS), *extra])
    lines = re.findall(r"step +(\d+) \| loss ([\d.]+)", stdout)
    assert [int(step) for step, _ in lines] == list(range(1, STEPS + 1))
    losses = [float(loss) for _, loss in lines]
    assert losses[-1] < losses[0] * 0.6, losses
    assert f"trained {STEPS} steps with GeminiStrategy on 2 ranks" in stdout
