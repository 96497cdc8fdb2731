"""The page keeps up with 8 ranks at 10 steps/s: every point arrives, drawing is coalesced."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from dashboard_support import (
    Server,
    chunks_event,
    finished_event,
    launch_chromium,
    page_recording_errors,
    post_events,
    started_event,
)
from dashboard_support import step_event as make_step

RANKS = 8
STEPS = 30
RATE = 10.0
NUM_CHUNKS = 64


def _rank(url: str, rank: int, failures: list[BaseException]) -> None:
    try:
        start = time.perf_counter()
        for step in range(STEPS):
            time.sleep(max(0.0, start + step / RATE - time.perf_counter()))
            events = [make_step("load", rank, step, loss=3.0 / (step + 1), overflow=step == 7)]
            if step % 10 == 0:
                snapshot = chunks_event("load", rank, step)
                snapshot["chunks"] = [dict(snapshot["chunks"][0], id=i) for i in range(NUM_CHUNKS)]
                events.append(snapshot)
            post_events(url, events)  # one POST per step, as a rank's emitter sends at this pace
        post_events(url, [finished_event("load", rank)])
    except BaseException as error:  # reported by the test thread
        failures.append(error)


def test_the_page_keeps_up_with_eight_ranks_at_ten_steps_per_second(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    server = Server(tmp_path / "runs.sqlite")
    try:
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page, errors = page_recording_errors(browser)
            page.goto(server.url + "/")
            page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)
            post_events(
                server.url, [started_event("load", r, world_size=RANKS) for r in range(RANKS)]
            )
            failures: list[BaseException] = []
            ranks = [
                threading.Thread(target=_rank, args=(server.url, r, failures)) for r in range(RANKS)
            ]
            began = time.perf_counter()
            for rank in ranks:
                rank.start()
            for rank in ranks:
                rank.join(60)
            sent_s = time.perf_counter() - began
            assert not failures, failures
            # Within a second of the last POST the page shows every point of every rank.
            page.wait_for_function(
                """([ranks, steps, chunks]) => {
                    const cards = [...document.querySelectorAll('#ranks .rank')];
                    return cards.length === ranks && cards.every(card =>
                        card.dataset.status === 'finished'
                        && card.querySelector('canvas[data-chart="loss"]').dataset.points
                           === String(steps)
                        && card.querySelectorAll('.chunk-map [data-chunk-id]').length === chunks);
                }""",
                arg=[RANKS, STEPS, NUM_CHUNKS],
                timeout=5_000,
            )
            body = page.evaluate("({...document.body.dataset})")
            marks = page.eval_on_selector_all(
                'canvas[data-chart="loss"]', "els => els.map(e => Number(e.dataset.marks))"
            )
            browser.close()
    finally:
        server.stop()
    assert not errors, errors
    assert marks == [1] * RANKS  # the overflow at step 7, on every rank
    messages, renders, render_ms = (
        int(body["messages"]),
        int(body["renders"]),
        float(body["renderMs"]),
    )
    assert messages >= RANKS * (STEPS + 1)
    # Drawing is per frame, not per event: fewer frames than messages, and drawing took a
    # minority of the time the ranks were sending.
    assert renders < messages, (renders, messages)
    assert render_ms < 0.5 * sent_s * 1000, (render_ms, sent_s)
    print(f"{messages} messages, {renders} frames, {render_ms:.0f} ms drawing in {sent_s:.1f} s")
