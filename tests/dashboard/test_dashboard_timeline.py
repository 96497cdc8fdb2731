"""Each rank's placement timeline (which chunk sat where, step by step) and bytes moved per
step: the API that serves the history, and the page that draws it and extends it live."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from dashboard_support import (
    Server,
    chunks_event,
    launch_chromium,
    page_recording_errors,
    post_events,
    started_event,
    step_event,
)

ROOT = Path(__file__).resolve().parents[2]
ARTIFACT = ROOT / "runs" / "test-artifacts" / "dashboard-timeline.png"  # runs/ is git-ignored
NUM_CHUNKS = 4
CHUNK_BYTES = 6002


def _snapshot(run_id: str, rank: int, step: int) -> dict[str, Any]:
    """Chunk `step % NUM_CHUNKS` sits on the host, the others on the device; chunk 0 is
    gathered, so every letter of D/d/H/h shows up."""
    event = chunks_event(run_id, rank, step)
    template = event["chunks"][0]
    event["chunks"] = [
        dict(
            template,
            id=i,
            payload="host" if i == step % NUM_CHUNKS else "device",
            state="gathered" if i == 0 else "sharded",
            optim="host" if i == step % NUM_CHUNKS else "device",
        )
        for i in range(NUM_CHUNKS)
    ]
    return event


def _letters(step: int) -> str:
    """The placement letters `_snapshot(..., step)` should give."""
    letters = ["H" if i == step % NUM_CHUNKS else "D" for i in range(NUM_CHUNKS)]
    return "".join(letter if i == 0 else letter.lower() for i, letter in enumerate(letters))


def _step(run_id: str, rank: int, step: int) -> dict[str, Any]:
    # Each step moves one chunk to the host and the one before back to the device.
    moved = {"to_device": CHUNK_BYTES * (step > 0), "to_host": CHUNK_BYTES}
    return step_event(run_id, rank, step, moved_bytes=moved)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_the_placement_timeline_of_a_rank_is_served_step_by_step(tmp_path: Path) -> None:
    server = Server(tmp_path / "runs.sqlite")
    try:
        events: list[dict[str, Any]] = [started_event("tl", r) for r in range(2)]
        for step in range(10):
            events += [_step("tl", 0, step), _snapshot("tl", 0, step)]
        events.append(_snapshot("tl", 1, 0))
        post_events(server.url, events)
        timeline = _get(server.url + "/api/v1/placement/tl?rank=0")
        assert timeline["steps"] == list(range(10))
        assert timeline["placement"] == [_letters(s) for s in range(10)]
        assert timeline["placement"][:2] == ["Hddd", "Dhdd"]
        assert timeline["optim"][1] == "DHDD"
        assert _get(server.url + "/api/v1/placement/tl?rank=1")["steps"] == [0]
        assert _get(server.url + "/api/v1/placement/tl?rank=5")["steps"] == []
        # Thinned to every k-th snapshot, keeping the latest.
        thin = _get(server.url + "/api/v1/placement/tl?rank=0&max_snapshots=4")
        assert thin["steps"] == [0, 3, 6, 9]
        assert thin["placement"] == [_letters(s) for s in (0, 3, 6, 9)]
        with pytest.raises(urllib.error.HTTPError) as missing:
            _get(server.url + "/api/v1/placement/nope?rank=0")
        assert missing.value.code == 404
    finally:
        server.stop()


def test_the_page_draws_each_ranks_timeline_and_extends_it_live(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    server = Server(tmp_path / "runs.sqlite")
    try:
        history: list[dict[str, Any]] = [started_event("tl", 0, world_size=1)]
        for step in range(10):
            history += [_step("tl", 0, step), _snapshot("tl", 0, step)]
        post_events(server.url, history)
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page, errors = page_recording_errors(browser, width=1300)
            page.goto(server.url + "/#run=tl")
            timeline = 'canvas[data-timeline="placement"][data-rank="0"]'
            # History: ten snapshots, two cells change between each pair.
            page.wait_for_function(
                f"""() => {{
                    const c = document.querySelector('{timeline}');
                    return c && c.dataset.snapshots === '10' && c.dataset.changes === '18';
                }}""",
                timeout=15_000,
            )
            before = _pixels(page, timeline)
            # Live: five more steps extend the timeline without a reload.
            live: list[dict[str, Any]] = []
            for step in range(10, 15):
                live += [_step("tl", 0, step), _snapshot("tl", 0, step)]
            post_events(server.url, live)
            page.wait_for_function(
                f"""() => {{
                    const c = document.querySelector('{timeline}');
                    return c.dataset.snapshots === '15' && c.dataset.changes === '28'
                        && c.dataset.lastStep === '14'
                        && document.querySelector('canvas[data-chart="moved"]').dataset.points
                           === '15';
                }}""",
                timeout=15_000,
            )
            after = _pixels(page, timeline)
            state = page.evaluate(
                f"""() => {{
                    const c = document.querySelector('{timeline}');
                    const moved = document.querySelector('canvas[data-chart="moved"]');
                    return {{chunks: c.dataset.chunks, hostCells: c.dataset.hostCells,
                             movedPoints: moved.dataset.points,
                             caption: c.parentElement.querySelector('.latest').textContent}};
                }}"""
            )
            ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACT), full_page=True)
            browser.close()
    finally:
        server.stop()
    assert not errors, errors
    assert state["chunks"] == str(NUM_CHUNKS)
    assert state["hostCells"] == "15"  # one chunk on the host per snapshot
    assert state["movedPoints"] == "15"
    assert state["caption"] == "4 chunks, 1 on host now; 28 moves over 15 snapshots"
    # The drawing itself: host (orange) and device (blue) cells, and it changed when the
    # live snapshots came (the columns narrowed and new ones appeared).
    assert before["orange"] > 0 and before["blue"] > 0
    assert after != before
    assert ARTIFACT.stat().st_size > 10_000


def _pixels(page: Any, selector: str) -> dict[str, int]:
    """Counts of device-blue and host-orange pixels on the timeline canvas, and a checksum."""
    result: dict[str, int] = page.evaluate(
        f"""() => {{
            const c = document.querySelector('{selector}');
            const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let blue = 0, orange = 0, sum = 0;
            for (let i = 0; i < data.length; i += 4) {{
                const [r, g, b] = [data[i], data[i + 1], data[i + 2]];
                if (b > 150 && r < 160) blue += 1;
                if (r > 180 && b < 160 && g > 90) orange += 1;
                sum = (sum * 31 + r + 7 * g + 13 * b) % 1000000007;
            }}
            return {{blue, orange, sum}};
        }}"""
    )
    return result


def _disk_snapshot(run_id: str, step: int) -> dict[str, Any]:
    """Chunks 0 and 1 keep their optimizer side on the disk tier, 2 and 3 on the host."""
    event = chunks_event(run_id, 0, step)
    template = event["chunks"][0]
    event["chunks"] = [
        dict(template, id=i, payload="host", state="sharded", optim="disk" if i < 2 else "host")
        for i in range(NUM_CHUNKS)
    ]
    return event


def _disk_step(run_id: str, step: int) -> dict[str, Any]:
    # Two chunks' masters and moments read in and written out each step.
    moved = {"to_device": 0, "to_host": 0, "to_disk": 3 * CHUNK_BYTES, "from_disk": 2 * CHUNK_BYTES}
    memory = {"device": 0, "host": 1 << 20, "disk": 2 << 20}
    return step_event(run_id, 0, step, moved_bytes=moved, memory=memory)


def test_the_disk_tier_shows_in_the_chunk_map_timeline_and_charts(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    server = Server(tmp_path / "runs.sqlite")
    try:
        events: list[dict[str, Any]] = [started_event("disk", 0, world_size=1)]
        for step in range(6):
            events += [_disk_step("disk", step), _disk_snapshot("disk", step)]
        post_events(server.url, events)
        timeline = _get(server.url + "/api/v1/placement/disk?rank=0")
        assert timeline["optim"] == ["SSHH"] * 6
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page, errors = page_recording_errors(browser, width=1300)
            page.goto(server.url + "/#run=disk")
            canvas = 'canvas[data-timeline="placement"][data-rank="0"]'
            page.wait_for_function(
                f"""() => {{
                    const c = document.querySelector('{canvas}');
                    const moved = document.querySelector('canvas[data-chart="moved"]');
                    return c && c.dataset.snapshots === '6' && moved
                        && moved.dataset.points === '6'
                        && document.querySelectorAll('.chunk-map [data-optim="disk"]').length;
                }}""",
                timeout=15_000,
            )
            state = page.evaluate(
                f"""() => {{
                    const c = document.querySelector('{canvas}');
                    const cells = [...document.querySelectorAll('.chunk-map [data-chunk-id]')];
                    const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                    let purple = 0;
                    for (let i = 0; i < data.length; i += 4) {{
                        const [r, g, b] = [data[i], data[i + 1], data[i + 2]];
                        if (r > 80 && r < 130 && g < 90 && b > 130) purple += 1;
                    }}
                    return {{
                        optim: cells.map(cell => cell.dataset.optim),
                        title: cells[0].title,
                        diskCells: c.dataset.diskCells,
                        caption: c.parentElement.querySelector('.latest').textContent,
                        purple,
                        movedValues: document.querySelector('canvas[data-chart="moved"]')
                            .dataset.values,
                        memoryValues: document.querySelector('canvas[data-chart="memory"]')
                            .dataset.values,
                        legend: document.getElementById('legend').textContent,
                    }};
                }}"""
            )
            browser.close()
    finally:
        server.stop()
    assert not errors, errors
    assert state["optim"] == ["disk", "disk", "host", "host"]
    assert "master and optimizer state on the disk tier" in state["title"]
    assert state["diskCells"] == "12"  # two chunks on disk in each of six snapshots
    assert (
        state["caption"] == "4 chunks, 4 on host, 2 on the disk tier now; 0 moves over 6 snapshots"
    )
    assert state["purple"] > 0
    # Four series of bytes moved (to and from the disk tier among them), three of memory.
    assert state["movedValues"] == str(4 * 6) and state["memoryValues"] == str(3 * 6)
    assert "the disk tier" in state["legend"]
