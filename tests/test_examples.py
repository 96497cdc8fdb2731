"""End to end: the demo script under torchrun, as a user launches it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from launch import torchrun

ROOT = Path(__file__).resolve().parent.parent


def test_demo_learns_the_text_under_auto_placement_with_a_held_out_loss(tmp_path: Path) -> None:
    telemetry = tmp_path / "telemetry"
    result = torchrun(
        ROOT / "examples" / "train_gpt.py",
        "--steps",
        "40",
        "--eval-every",
        "20",
        # Its telemetry to files, never to a dashboard the environment may name.
        env={"SHARDWISE_TELEMETRY_FILE": str(telemetry), "SHARDWISE_DASHBOARD_URL": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ZeRO stage 3 on 2 ranks" in result.stdout
    budget = re.search(
        r"device budget ([\d.]+) MiB per rank, \d+% of the ([\d.]+) MiB", result.stdout
    )
    assert budget is not None, result.stdout[-3000:]
    assert float(budget[1]) < float(budget[2])  # below the model state: chunks must move
    lines = re.findall(
        r"step +(\d+) \| loss ([\d.]+) \| .*? \| moved ([\d.]+) MiB(?: \| eval loss ([\d.]+))?",
        result.stdout,
    )
    assert [int(step) for step, *_ in lines] == list(range(40))
    losses = [float(loss) for _, loss, _, _ in lines]
    # Bytes of a uniform guess: ln 256 = 5.55; the text's byte frequencies alone give ~3.3.
    assert losses[0] > 5.0
    assert max(losses[-5:]) < 3.8
    # Under "auto" with a budget below the model state, every step moves chunks.
    assert all(float(moved) > 0 for _, _, moved, _ in lines)
    evals = {int(step): float(value) for step, _, _, value in lines if value}
    assert sorted(evals) == [19, 39]
    assert evals[39] < 3.8
    assert evals[39] < evals[19] + 0.05  # held-out loss does not rise as training goes on

    # What each rank's telemetry says. At this budget (below the model state) "auto" keeps
    # some chunks' shards on the device and the others in host memory, moved in for every
    # step: one snapshot holds both pools, on every rank, at every step.
    for rank in range(2):
        events = [
            json.loads(line)
            for line in Path(f"{telemetry}.rank{rank}.jsonl").read_text().splitlines()
        ]
        steps = [e for e in events if e["type"] == "step"]
        assert [e["step"] for e in steps] == list(range(40))
        assert all(sum(e["moved_bytes"].values()) > 0 for e in steps)
        assert all(e["memory"]["device"] > 0 and e["memory"]["host"] > 0 for e in steps)
        snapshots = [e for e in events if e["type"] == "chunks"]
        assert [e["step"] for e in snapshots] == list(range(40))
        for snapshot in snapshots:
            pools = [chunk["payload"] for chunk in snapshot["chunks"]]
            assert 0 < pools.count("device") < len(pools), (snapshot["step"], pools)
        # The evaluations, with the losses printed (the same on every rank: all-reduced).
        reported = {e["step"]: e["loss"] for e in events if e["type"] == "eval"}
        assert sorted(reported) == [19, 39]
        assert all(abs(reported[step] - evals[step]) <= 5e-5 for step in reported)
