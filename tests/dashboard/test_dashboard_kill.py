"""Killing the dashboard in the middle of a run leaves the training run undisturbed."""

from __future__ import annotations

from pathlib import Path

from dashboard_support import Server
from dashboard_training import CHUNK_EVERY, train_without_then_with_telemetry

from shardwise.testing import run_ranks
from shardwise_dashboard.storage import RunStore

STEPS = 8
KILL_AT = 3


def test_killing_the_dashboard_mid_run_does_not_disturb_training(tmp_path: Path) -> None:
    server = Server(tmp_path / "runs.sqlite")
    try:
        runs = run_ranks(
            train_without_then_with_telemetry, 2, server.url, STEPS, KILL_AT, server.process.pid
        )
        assert server.process.wait(timeout=10) == -9  # it really was killed, by rank 0
    finally:
        server.stop()
    reference, streamed = [plain for plain, _ in runs], [live for _, live in runs]

    snapshots = len(range(0, STEPS, CHUNK_EVERY))
    emitted = 1 + STEPS + snapshots + 1  # run_started, steps, chunk snapshots, run_finished
    for rank, (ref, run) in enumerate(zip(reference, streamed, strict=True)):
        # The run finished, with exactly the losses of a run without telemetry.
        assert run["losses"] == ref["losses"] and len(run["losses"]) == STEPS
        # Everything emitted after the kill (steps KILL_AT.., run_finished) was dropped and
        # counted; every event is either delivered or counted as dropped.
        assert run["dropped"] >= STEPS - KILL_AT + 1
        assert run["delivered"] + run["dropped"] == emitted
        (warning,) = run["warnings"]
        assert f"rank {rank}: {run['dropped']} events could not be delivered" in warning

    # What the dashboard acknowledged before it died was committed and is still there.
    store = RunStore(tmp_path / "runs.sqlite")
    try:
        stored = store.count_events(streamed[0]["run_id"])
    finally:
        store.close()
    assert sum(r["delivered"] for r in streamed) <= stored <= 2 * emitted
    assert stored >= 1
