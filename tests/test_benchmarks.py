"""The interleaved benchmark trains every engine alike: torch's and shardwise's engines, each on
its own copy of the model in one process group, reach bit-identical losses (2 ranks, fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_interleaved_engines_reach_identical_losses(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    engines = "ddp,zero1,zero2,zero2+pg,fsdp2,zero3-cuda,zero3-cpu,zero2-rs"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(ROOT / "benchmarks" / "bench_ab.py"), "--engines", engines, "--out", str(out),
        "--rounds", "2", "--warmup", "1", "--n-layer", "2", "--n-embd", "64", "--vocab", "512",
        "--seq", "32", "--chunk-mib", "0.1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(out.read_text())
    runs = summary["engines"]
    assert list(runs) == engines.split(",")
    # 1 warm-up step, then 2 rounds of 3-step turns, the first of each turn not timed.
    assert summary["steps_per_engine"] == 7
    assert all(
        len(run["step_ms"]) == 4 and len(run["round_median_ms"]) == 2 for run in runs.values()
    )
    losses = {name: run["final_loss"] for name, run in runs.items()}
    assert len(set(losses.values())) == 1, losses
