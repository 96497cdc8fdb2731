"""History stays bounded: old runs deleted, old steps thinned, a size cap; and batches that
arrive together share one commit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from dashboard_support import chunks_event, step_event

from shardwise_dashboard.retention import Retention
from shardwise_dashboard.storage import RunStore
from shardwise_dashboard.writer import BatchWriter

HOUR = 3600.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _steps(run_id: str, start: float, steps: int, overflow_at: int = -1) -> list[dict[str, Any]]:
    return [
        step_event(run_id, rank, s, time=start + s, overflow=s == overflow_at)
        for rank in (0, 1)
        for s in range(steps)
    ]


def test_old_steps_are_thinned_and_overflows_kept(tmp_path: Path) -> None:
    clock = Clock(1e9)
    store = RunStore(tmp_path / "runs.sqlite", clock=clock)
    start = clock.now - 2 * HOUR  # the first 100 steps are two hours old, the next 100 new
    store.add(_steps("r", start, 100, overflow_at=37))
    snapshots = [chunks_event("r", 0, s) | {"time": start + s} for s in range(0, 100, 10)]
    store.add(snapshots)
    store.add(
        [step_event("r", rank, s, time=clock.now) for rank in (0, 1) for s in range(100, 200)]
    )
    retention = Retention(store, max_age_s=None, max_bytes=None, thin_after_s=HOUR, thin_every=10)
    report = retention.run_once()
    kept = store.run("r", rank=0)
    assert kept is not None
    steps = [e["step"] for e in kept["ranks"][0]["steps"]]
    assert steps == sorted({*range(0, 100, 10), 37, *range(100, 200)})
    # Snapshots: every 100th step and the rank's latest survive.
    assert kept["ranks"][0]["chunks"]["step"] == 90
    ((left,),) = store.execute("SELECT count(*) FROM events WHERE type = 'chunks'")
    assert left == 2  # steps 0 and 90
    assert report.events_thinned == 2 * (100 - 11) + 8
    assert retention.run_once().events_thinned == 0  # a second pass finds nothing new
    store.close()


def test_old_runs_go_and_a_size_cap_deletes_the_oldest_first(tmp_path: Path) -> None:
    clock = Clock(1e9)
    store = RunStore(tmp_path / "runs.sqlite", clock=clock)
    for age_days, run_id in ((40, "ancient"), (3, "older"), (2, "old"), (0, "new")):
        clock.now = 1e9 - age_days * 86400
        store.add(_steps(run_id, clock.now, 200))
    clock.now = 1e9
    by_age = Retention(store, max_age_s=30 * 86400, max_bytes=None, thin_after_s=None)
    assert by_age.run_once().runs_deleted == ["ancient"]
    used = by_age.used_bytes()
    by_size = Retention(store, max_age_s=None, max_bytes=used // 2, thin_after_s=None)
    report = by_size.run_once()
    assert report.runs_deleted[:2] == ["older", "old"]
    assert [run["run_id"] for run in store.runs()] == ["new"]  # the last run is never deleted
    assert report.used_bytes < used
    store.close()


def _steps_kept(store: RunStore) -> list[int]:
    detail = store.run("only")
    assert detail is not None
    return [event["step"] for event in detail["ranks"][0]["steps"]]


def test_a_single_run_over_the_cap_is_thinned_deeper_not_deleted(tmp_path: Path) -> None:
    clock = Clock(1e9)
    store = RunStore(tmp_path / "runs.sqlite", clock=clock)
    store.add([step_event("only", 0, s, overflow=s == 333) for s in range(2000)])
    retention = Retention(store, max_age_s=None, max_bytes=1, thin_after_s=None)
    first = retention.run_once()
    kept = _steps_kept(store)
    # The older half to every 100th step (the overflow kept), the newer half whole.
    assert kept == sorted({*range(0, 999, 100), 333, *range(999, 2000)}), kept[:20]
    assert first.runs_deleted == [] and [r["run_id"] for r in store.runs()] == ["only"]
    retention.run_once()  # still over: the older half, to every 1,000th
    kept = _steps_kept(store)
    assert kept[:4] == [0, 333, 999, 1000]
    store.close()


def test_batches_that_arrive_together_share_a_commit(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.sqlite")
    writer = BatchWriter(store)

    async def post_many() -> None:
        await asyncio.gather(*(writer.write([step_event("g", r, 0)]) for r in range(64)))

    asyncio.run(post_many())
    writer.close()
    assert store.count_events("g") == 64 and writer.batches == 64
    assert writer.commits <= 8, writer.commits
    store.close()
