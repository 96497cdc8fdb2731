"""A short run of the ingestion load benchmark: 8 simulated ranks at 10 steps/s lose nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_eight_ranks_at_ten_steps_per_second_lose_nothing() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_dashboard.py")]
    options = ["--ranks", "8", "--rate", "10", "--seconds", "3", "--saturate-seconds", "1"]
    result = subprocess.run(
        [*command, *options, "--no-write"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    paced, saturation = json.loads(result.stdout)["phases"]
    # 8 ranks x ~30 steps, plus a chunk snapshot every 10 steps: all accepted and stored.
    assert paced["events_sent"] >= 8 * 25
    assert paced["events_accepted"] == paced["events_stored"] == paced["events_sent"]
    assert paced["failed_posts"] == 0 and paced["lost"] == 0
    assert saturation["lost"] == 0 and saturation["events_stored"] == saturation["events_accepted"]
    assert saturation["events_per_s"] > paced["events_per_s"]
