"""A 1,024-rank run on one screen: the page loads its overview, and shows its first live update,
within 2 s each in headless Chromium; the outlier ranks are named and lead to their detail."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dashboard_support import (
    Server,
    chunks_event,
    launch_chromium,
    page_recording_errors,
    post_events,
    started_event,
    step_event,
)

from shardwise_dashboard.storage import RunStore

ROOT = Path(__file__).resolve().parents[2]
ARTIFACT = ROOT / "runs" / "test-artifacts" / "dashboard-overview-1024.png"  # git-ignored
RANKS = 1024
STEPS = 60
CHUNKS = 64
SLOW, TRAFFIC, MEMORY, FIRST_OVERFLOW, STALE = 613, 77, 300, 5, 999
WARNING = "steps 40-42 skipped: gradients not finite 3 times in a row"


def _snapshot(rank: int, step: int, on_host: int) -> dict[str, Any]:
    event = chunks_event("big", rank, step)
    row = event["chunks"][0]
    event["chunks"] = [
        dict(row, id=i, payload="host" if i < on_host else "device", state="sharded")
        for i in range(CHUNKS)
    ]
    return event


def _rank_history(rank: int) -> list[dict[str, Any]]:
    events = [started_event("big", rank, world_size=RANKS)]
    for step in range(STEPS):
        skipped = step - 39 if 40 <= step <= 42 else 0
        events.append(
            step_event(
                "big",
                rank,
                step,
                step_time_s=0.5 if rank == SLOW else 0.1 + 0.0001 * (rank % 10),
                moved_bytes={"to_device": 2**30 if rank == TRAFFIC else 0, "to_host": 0},
                memory={"device": 2**33 if rank == MEMORY else 2**32, "host": 0},
                overflow=40 <= step <= 42 or (rank == FIRST_OVERFLOW and step == 17),
                skipped_in_a_row=skipped,
                warning=WARNING if step == 42 else None,
            )
        )
        if step % 10 == 0:
            events.append(_snapshot(rank, step, on_host=32 if rank == TRAFFIC else 0))
    return events


def _preload(db: Path) -> None:
    store = RunStore(db)
    batch: list[dict[str, Any]] = []
    for rank in range(RANKS):
        if rank != STALE:
            batch += _rank_history(rank)
        if len(batch) > 8000:
            store.add(batch)
            batch = []
    store.add(batch)
    store.close()
    # This rank went silent long ago, as far as the server can tell.
    old = RunStore(db, clock=lambda: time.time() - 3600)
    old.add(_rank_history(STALE))
    old.close()


def _outliers(page: Any) -> dict[str, int]:
    return page.eval_on_selector_all(
        "#outliers li[data-kind]",
        "items => Object.fromEntries(items.map(li => [li.dataset.kind, Number(li.dataset.rank)]))",
    )


def test_a_thousand_ranks_fit_one_screen_and_update_live(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    db = tmp_path / "runs.sqlite"
    _preload(db)
    server = Server(db)
    try:
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page, errors = page_recording_errors(browser)
            began = time.perf_counter()
            page.goto(server.url + "/#run=big")
            page.wait_for_selector(
                f'#overview[data-ranks="{RANKS}"][data-last-step="{STEPS - 1}"]', timeout=10_000
            )
            page.wait_for_selector(
                f'#heatmap[data-ranks="{RANKS}"][data-chunks="{CHUNKS}"][data-host-chunks="32"]'
            )
            load_s = time.perf_counter() - began
            page.wait_for_selector('#connection[data-state="live"]', timeout=10_000)
            page.wait_for_selector('#run-list li[data-run-id="big"]', timeout=10_000)
            outliers = _outliers(page)
            warning = page.inner_text("#run-warning")
            shown_cards = page.locator("#ranks .rank").count()
            ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACT))

            # The next step of every rank, and a new placement on one: live within 2 s.
            live = [step_event("big", r, STEPS) for r in range(RANKS) if r != STALE]
            live.append(_snapshot(42, STEPS, on_host=CHUNKS))
            posted = time.perf_counter()
            post_events(server.url, live)
            page.wait_for_selector(f'#overview[data-last-step="{STEPS}"]', timeout=10_000)
            live_s = time.perf_counter() - posted
            host_chunks = page.get_attribute("#heatmap", "data-host-chunks")

            # The slowest rank's detail is one click away.
            page.click('#outliers li[data-kind="slowest"] .rank-link')
            page.wait_for_selector(
                f'#ranks .rank[data-rank="{SLOW}"] canvas[data-chart="loss"]'
                f'[data-points="{STEPS + 1}"]',
                timeout=10_000,
            )
            detail_cards = page.locator("#ranks .rank").count()
            browser.close()
    finally:
        server.stop()
    assert not errors, errors
    print(f"1,024 ranks: overview loaded in {load_s:.2f} s, live step shown {live_s:.2f} s after")
    assert load_s < 2.0, load_s
    assert live_s < 2.0, live_s
    assert outliers == {
        "warning": 0,
        "stale": STALE,
        "overflow": FIRST_OVERFLOW,
        "slowest": SLOW,
        "traffic": TRAFFIC,
        "memory": MEMORY,
    }
    assert WARNING in warning and "1024 ranks" in warning
    assert host_chunks == str(32 + CHUNKS)  # rank 42's chunks moved to the host, live
    assert shown_cards == 0  # no card per rank at this size: the overview stands in
    assert detail_cards == 1
