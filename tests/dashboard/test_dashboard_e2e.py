"""End to end: a 2-rank training run streams into a real dashboard server, and headless
Chromium, which loaded the page before the run began, shows it live, evaluations included, and
the bytes on the wire of its int8 gathers and reductions against the unquantized figure."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path
from typing import Any

from dashboard_support import Server, launch_chromium, page_recording_errors
from dashboard_training import CHUNK_EVERY, train

from shardwise.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
ARTIFACT = ROOT / "runs" / "test-artifacts" / "dashboard-e2e.png"  # runs/ is git-ignored
STEPS = 12
EVAL_EVERY = 4  # evaluations after steps 3, 7 and 11
WORLD = 2
WIRE = {"gather_format": "int8", "reduce_format": "int8"}


def _page_state(page: Any, run_id: str) -> dict[str, Any]:
    return page.evaluate(
        """(runId) => {
          // Pixels of the evaluation series' colour (#e08a1e) on a chart.
          const orangePixels = (canvas) => {
            const { width, height } = canvas;
            const data = canvas.getContext('2d').getImageData(0, 0, width, height).data;
            let count = 0;
            for (let i = 0; i < data.length; i += 4) {
              const [r, g, b] = [data[i], data[i + 1], data[i + 2]];
              if (r > 180 && g > 100 && g < 170 && b < 80) count += 1;
            }
            return count;
          };
          return {
            listed: [...document.querySelectorAll('#run-list li')].map(li => li.dataset.runId),
            shown: document.getElementById('run').dataset.runId,
            status: document.getElementById('run').dataset.status,
            ranks: [...document.querySelectorAll('#ranks .rank')].map(card => ({
                rank: Number(card.dataset.rank),
                status: card.dataset.status,
                mapRank: Number(card.querySelector('.chunk-map').dataset.rank),
                cells: [...card.querySelectorAll('.chunk-map [data-chunk-id]')].map(
                    cell => [Number(cell.dataset.chunkId), cell.dataset.payload]),
                lossPoints: Number(card.querySelector('canvas[data-chart="loss"]').dataset.points),
                lossValues: Number(card.querySelector('canvas[data-chart="loss"]').dataset.values),
                scalePoints: Number(
                    card.querySelector('canvas[data-chart="loss-scale"]').dataset.points),
                evalValues: Number(
                    card.querySelector('canvas[data-chart="loss"]').dataset.sparseValues),
                evalLoss: card.querySelector('.latest-eval').dataset.evalLoss,
                evalStep: card.querySelector('.latest-eval').dataset.evalStep,
                evalText: card.querySelector('.latest-eval').textContent,
                evalShown: !card.querySelector('.latest-eval').hidden,
                evalPixels: orangePixels(card.querySelector('canvas[data-chart="loss"]')),
                commValues: Number(card.querySelector('canvas[data-chart="comm"]').dataset.values),
                wireText: card.querySelector('canvas[data-chart="comm"]')
                    .parentElement.querySelector('.latest').textContent,
                wireBytes: card.querySelector('canvas[data-chart="comm"]')
                    .parentElement.querySelector('.latest').dataset.wireBytes,
                unquantizedBytes: card.querySelector('canvas[data-chart="comm"]')
                    .parentElement.querySelector('.latest').dataset.unquantizedBytes,
                wireRatio: card.querySelector('canvas[data-chart="comm"]')
                    .parentElement.querySelector('.latest').dataset.wireRatio,
            })),
            reloaded: window.__sameDocument !== true,
          };
        }""",
        run_id,
    )


def test_a_training_run_appears_live_in_the_browser(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    server = Server(tmp_path / "runs.sqlite")
    try:
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page, errors = page_recording_errors(browser)
            page.on(
                "console",
                lambda message: errors.append(message.text) if message.type == "error" else None,
            )
            page.goto(server.url + "/")
            page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)
            assert page.locator("#run-list li").count() == 0
            page.evaluate("window.__sameDocument = true")

            results = run_ranks(
                train, WORLD, server.url, STEPS, eval_every=EVAL_EVERY, wire=WIRE, timeout_s=120
            )

            run_id = results[0]["run_id"]
            assert all(r["run_id"] == run_id for r in results)  # one run, shared by the ranks
            chunk_counts = [len(r["chunk_ids"]) for r in results]
            assert all(count > 1 for count in chunk_counts)
            # Wait (without reloading) until the page shows the finished run in full.
            page.wait_for_function(
                """([runId, steps, counts]) => {
                    const cards = document.querySelectorAll('#ranks .rank');
                    return document.getElementById('run').dataset.runId === runId
                        && document.getElementById('run').dataset.status === 'finished'
                        && cards.length === counts.length
                        && [...cards].every((card, r) =>
                            card.querySelectorAll('.chunk-map [data-chunk-id]').length === counts[r]
                            && card.querySelector('canvas[data-chart="loss"]').dataset.points
                               === String(steps)
                            && card.querySelector('.latest-eval').dataset.evalStep
                               === String(steps - 1));
                }""",
                arg=[run_id, STEPS, chunk_counts],
                timeout=20_000,
            )
            state = _page_state(page, run_id)
            screenshot = tmp_path / "dashboard-e2e.png"
            page.screenshot(path=str(screenshot), full_page=True)
            browser.close()
    finally:
        server.stop()
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(screenshot, ARTIFACT)

    assert not errors, errors
    assert not state["reloaded"], "the page was reloaded: the run must arrive live"
    assert state["listed"] == [run_id] and state["shown"] == run_id
    for rank, (shown, result) in enumerate(zip(state["ranks"], results, strict=True)):
        assert (shown["rank"], shown["mapRank"], shown["status"]) == (rank, rank, "finished")
        # One cell per chunk of the engine, in its order; placement "cuda" on a CPU host keeps
        # every payload on the compute device.
        assert shown["cells"] == [[chunk_id, "device"] for chunk_id in result["chunk_ids"]]
        assert shown["lossPoints"] == shown["lossValues"] == shown["scalePoints"] == STEPS
        # The evaluations: drawn on the loss chart in their own colour, the latest in its
        # caption, with the loss the ranks computed (all-reduced: the same on each).
        assert [step for step, _ in result["evals"]] == [3, 7, 11]
        last_step, last_loss = result["evals"][-1]
        assert shown["evalValues"] == 3 and shown["evalShown"]
        assert float(shown["evalLoss"]) == last_loss and shown["evalStep"] == str(last_step)
        shown_loss, at = shown["evalText"].removeprefix("eval ").split(" @ ")
        assert abs(float(shown_loss) - last_loss) < 0.01 and at == str(last_step)
        assert shown["evalPixels"] > 20
        # The latest step's bytes on the wire and their share of the unquantized figure, as
        # the rank's counters said: two series of a value per step.
        sent, unquantized = result["wire_bytes"][-1]
        assert shown["commValues"] == 2 * STEPS
        assert (shown["wireBytes"], shown["unquantizedBytes"]) == (str(sent), str(unquantized))
        assert float(shown["wireRatio"]) == sent / unquantized < 0.5
        assert shown["wireText"].endswith(f" ({sent / unquantized:.2f} of unquantized)")
    assert screenshot.stat().st_size > 10_000

    # What the server kept is exactly what the ranks computed.
    server = Server(tmp_path / "runs.sqlite")  # a restart, too
    try:
        with urllib.request.urlopen(f"{server.url}/api/v1/runs/{run_id}", timeout=10) as answer:
            detail = json.load(answer)
    finally:
        server.stop()
    assert detail["status"] == "finished" and detail["world_size"] == WORLD
    for rank_detail, result in zip(detail["ranks"], results, strict=True):
        assert [e["loss"] for e in rank_detail["steps"]] == result["losses"]
        assert [
            [sum(e["comm_bytes"].values()), sum(e["comm_bytes_unquantized"].values())]
            for e in rank_detail["steps"]
        ] == result["wire_bytes"]
        assert [[e["step"], e["loss"]] for e in rank_detail["evals"]] == result["evals"]
        assert rank_detail["chunks"]["step"] == (STEPS - 1) // CHUNK_EVERY * CHUNK_EVERY
        assert rank_detail["dropped"] == 0 and result["dropped"] == 0
