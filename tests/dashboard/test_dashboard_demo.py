"""`./dev demo`: the dashboard starts, its URL is printed, the run lands in it, all stops."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

from dashboard_support import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_streams_its_run_into_the_dashboard_it_starts() -> None:
    port = free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("SHARDWISE_DASHBOARD_URL", None)
    nox = [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s", "demo"]
    result = subprocess.run(
        [*nox, "--", "--hold", "0", "--port", str(port), "--steps", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    url = f"http://127.0.0.1:{port}"
    assert f"dashboard: open {url} to watch the run live" in output
    # Rank 0 printed where the run goes: its page on the dashboard.
    (run_id,) = re.findall(
        rf"shardwise: telemetry of run (\S+) \(.*\) goes to {re.escape(url)}/#run=", output
    )
    assert "dashboard stopped" in output
    with sqlite3.connect(ROOT / "runs" / "dashboard.sqlite") as db:
        ranks = db.execute(
            "SELECT rank, status, num_steps FROM ranks WHERE run_id = ? ORDER BY rank", (run_id,)
        ).fetchall()
        # The evaluation after the last step, from every rank, with the loss the run printed.
        evals = db.execute(
            "SELECT rank, step, json_extract(body, '$.loss') FROM events "
            "WHERE run_id = ? AND type = 'eval' ORDER BY rank",
            (run_id,),
        ).fetchall()
    assert ranks == [(0, "finished", 3), (1, "finished", 3)]
    (printed,) = re.findall(r"step +2 \|.*\| eval loss ([\d.]+)", output)
    assert [(rank, step) for rank, step, _ in evals] == [(0, 2), (1, 2)]
    assert all(abs(loss - float(printed)) <= 5e-5 for _, _, loss in evals)
    assert not any("shardwise_dashboard serve --port " + str(port) in line for line in _procs())


def _procs() -> list[str]:
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    return listing.stdout.splitlines()
