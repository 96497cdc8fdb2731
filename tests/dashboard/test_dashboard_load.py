"""A short run of the ingestion load benchmark: 64 simulated ranks, 8 per node, lose nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sixty_four_ranks_lose_nothing_and_share_a_sender_per_node() -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_dashboard.py")]
    options = ["--ranks", "64", "--rate", "4", "--seconds", "3", "--chunk-every", "4"]
    options += ["--saturate-seconds", "1"]
    result = subprocess.run(
        [*command, *options, "--no-write"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    node, saturation = json.loads(result.stdout)["phases"]
    # 64 ranks x ~12 steps, plus a chunk snapshot every 4 steps: all accepted and stored.
    assert node["events_sent"] >= 64 * 10
    assert node["events_accepted"] == node["events_stored"] == node["events_sent"]
    assert node["failed_posts"] == 0 and node["lost"] == 0
    # One sender per 8 ranks, each posting once per flush interval (0.5 s): 2 steps a POST.
    assert node["senders"] == 8 and node["posts"] <= 8 * 14
    assert saturation["lost"] == 0 and saturation["events_stored"] == saturation["events_accepted"]
    assert saturation["events_per_s"] > node["events_per_s"]
    assert node["db_mb_per_hour_thinned"] < node["db_mb_per_hour"]
