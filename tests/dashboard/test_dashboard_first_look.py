"""What the page says at first sight, in headless Chromium: "No run yet" only when the server
has no run (never while its list is on its way); "look here first" lists only ranks that stand
out (none of two ranks alike, where it used to list them at 1.00x the median); a flat series,
or one varying only in digits its axis does not print, is drawn flat between two labels that
differ, not as separate lines between identical labels."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dashboard_support import (
    Server,
    finished_event,
    launch_chromium,
    page_recording_errors,
    post_events,
    started_event,
    step_event,
)

from shardwise_dashboard.storage import RunStore

# Records, from before the page's own script runs, every moment "No run yet" was visible.
_WATCH_NO_RUNS = """
window.noRunsSeen = 0;
const check = () => {
  const el = document.getElementById('no-runs');
  if (el && !el.hidden && el.getClientRects().length) window.noRunsSeen += 1;
};
new MutationObserver(check).observe(document, {subtree: true, childList: true, attributes: true});
const tick = () => { check(); requestAnimationFrame(tick); };
requestAnimationFrame(tick);
"""

_LOADING_HIDDEN = "document.getElementById('runs-loading')?.hidden ?? true"

# Per chart canvas of a rank's card: its axis labels, and the pixel rows its series covers
# inside the plot (blue: the loss; dark grey: the step time).
_CHARTS = """rank => Object.fromEntries(
  [...document.querySelectorAll(`#ranks .rank[data-rank="${rank}"] canvas[data-chart]`)]
  .map(canvas => {
    const ctx = canvas.getContext('2d');
    const {data, width, height} = ctx.getImageData(0, 0, canvas.width, canvas.height);
    const rows = new Set();
    for (let y = 0; y < height; y++) {
      for (let x = 60; x < width; x++) {
        const i = 4 * (y * width + x);
        const [r, g, b, a] = [data[i], data[i + 1], data[i + 2], data[i + 3]];
        const blue = b - r > 80 && b - g > 40;
        const grey = canvas.dataset.chart === 'step-time' && r < 100 && g < 100 && b < 100;
        if (a > 128 && (blue || grey)) { rows.add(y); break; }
      }
    }
    const axis = canvas.dataset.axis ? JSON.parse(canvas.dataset.axis) : [null, null];
    return [canvas.dataset.chart, {axis, rows: rows.size}];
  }))"""


def test_no_run_yet_is_said_only_when_there_is_none(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    db = tmp_path / "runs.sqlite"
    store = RunStore(db)
    store.add([started_event("kept"), step_event("kept"), finished_event("kept")])
    store.close()
    server = Server(db)
    empty = Server(tmp_path / "empty.sqlite")
    try:
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page, errors = page_recording_errors(browser)
            page.add_init_script(_WATCH_NO_RUNS)

            def slow_runs(route: Any) -> None:
                time.sleep(1.0)  # the answer takes a while: the page paints before it
                route.continue_()

            page.route("**/api/v1/runs", slow_runs)
            page.goto(server.url + "/")
            page.wait_for_selector('#run-list li[data-run-id="kept"]', timeout=15_000)
            seen_with_runs = page.evaluate("window.noRunsSeen")
            loading_hidden = page.evaluate(_LOADING_HIDDEN)
            page.unroute("**/api/v1/runs")
            page.goto(empty.url + "/")
            page.wait_for_selector("#no-runs:visible", timeout=15_000)
            loading_after = page.evaluate(_LOADING_HIDDEN)
            browser.close()
    finally:
        server.stop()
        empty.stop()
    assert not errors, errors
    assert seen_with_runs == 0  # never, while the list of one run was on its way
    assert loading_hidden and loading_after  # "Loading runs" gone once the list came


def _two_alike_ranks(run_id: str, steps: int) -> list[dict[str, Any]]:
    """Rank 0: a loss and a step time that take three values a few millionths apart (three
    levels in digits their axes do not print), and a flat grad norm; rank 1: a falling loss.
    Otherwise alike."""
    events = [started_event(run_id, rank) for rank in range(2)]
    for step in range(steps):
        wobble = step % 3
        events.append(
            step_event(run_id, 0, step, loss=2.5 + 1e-6 * wobble, step_time_s=0.125 + 1e-7 * wobble)
        )
        events.append(step_event(run_id, 1, step, loss=3.0 - 0.1 * step))
    return events


def test_flat_series_and_ranks_alike_are_shown_as_such(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    server = Server(tmp_path / "runs.sqlite")
    try:
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page, errors = page_recording_errors(browser)
            post_events(server.url, _two_alike_ranks("alike", 12))
            page.goto(server.url + "/#run=alike")
            page.wait_for_function(
                """() => [...document.querySelectorAll('#ranks .rank')].length === 2
                    && [...document.querySelectorAll('canvas[data-chart="loss"]')]
                       .every(c => c.dataset.points === '12')
                    && document.querySelector('#outliers li') !== null""",
                timeout=15_000,
            )
            page.wait_for_timeout(400)  # the charts' next frame
            flat, varying = page.evaluate(_CHARTS, 0), page.evaluate(_CHARTS, 1)
            alike = page.eval_on_selector_all("#outliers li", "els => els.map(e => e.className)")
            # Rank 1 turns slow: now it stands out, and only it.
            post_events(server.url, [step_event("alike", 1, 12, step_time_s=2.0)])
            page.wait_for_selector('#outliers li[data-kind="slowest"]', timeout=15_000)
            listed = page.eval_on_selector_all(
                "#outliers li", "els => els.map(e => [e.dataset.kind, e.dataset.rank])"
            )
            browser.close()
    finally:
        server.stop()
    assert not errors, errors
    for rank in (flat, varying):
        for chart, drawn in rank.items():
            low, high = drawn["axis"]
            assert low is not None and low != high, (chart, drawn)  # labels that differ
    # Nearly flat series are lines a few pixels high; a falling one spans the plot.
    assert flat["loss"]["rows"] <= 3, flat
    assert flat["step-time"]["rows"] <= 3, flat
    assert varying["loss"]["rows"] > 30, varying
    assert alike == ["outlier-none"]  # "nothing stands out", not the largest at 1.00x
    assert listed == [["slowest", "1"]], listed
