"""Every entry point streams to the dashboard from the environment alone: with only
SHARDWISE_DASHBOARD_URL set, a Lightning fit (GeminiStrategy), a Booster run (GeminiPlugin) and
a `zero_optim_wrapper` loop, none of which calls `telemetry.enable`, each appear live in headless
Chromium (opened before the runs began) as a finished run with one loss point per step on each
rank. The runs list tells them apart (the front door that started each, its script, and the
name SHARDWISE_RUN_NAME gave one), and the page rank 0 printed at the start opens its run."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from dashboard_support import Server, launch_chromium, page_recording_errors
from helpers import CHUNK_NUMEL, batch_slice, make_model
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shardwise import HybridAdam, telemetry, zero_model_wrapper, zero_optim_wrapper
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin
from shardwise.testing import run_ranks
from shardwise_lightning import GeminiStrategy

STEPS = 4
WORLD = 2


def _loop(model: Any, optimizer: Any, backward: Any) -> None:
    for step in range(STEPS):
        optimizer.zero_grad()
        backward(model(*batch_slice(step, 0, dist.get_rank(), WORLD)))
        optimizer.step()


RUN_NAME = "booster, lr 1e-2"


def _zero_optim_wrapper_run(url: str) -> str:
    os.environ["SHARDWISE_DASHBOARD_URL"] = url  # this rank's process only
    return _dropped(_zero_optim_wrapper_loop())


def _booster_run(url: str) -> tuple[str, str]:
    """The run's id, and what this rank printed to stderr as it started."""
    os.environ["SHARDWISE_DASHBOARD_URL"] = url
    os.environ["SHARDWISE_RUN_NAME"] = RUN_NAME
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        run_id = _dropped(_booster_loop())
    return run_id, said.getvalue()


def _dropped(run_id: str) -> str:
    """The run's model and optimizer are gone with the loop's frame: collected, the run is
    reported finished and its events delivered."""
    gc.collect()
    return run_id


def _zero_optim_wrapper_loop() -> str:
    model = make_model()
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL}
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _loop(wrapped, optimizer, optimizer.backward)
    return _run_id(wrapped, optimizer)


def _booster_loop() -> str:
    booster = Booster(plugin=GeminiPlugin(precision="fp32"))
    model = make_model()
    boosted, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-2))
    _loop(boosted, optimizer, lambda loss: booster.backward(loss, optimizer))
    return _run_id(boosted, optimizer.engine)


def _run_id(model: Any, optimizer: Any) -> str:
    """The id of the run the front door started (enable() returns its recorder)."""
    recorder = telemetry.enable(model, optimizer)
    assert recorder is not None
    return recorder.emitter.run_id


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _lightning_run(url: str) -> int:
    os.environ["SHARDWISE_DASHBOARD_URL"] = url
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(
        strategy=GeminiStrategy(), accelerator="cpu", devices=WORLD, max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Regression(), DataLoader(data, batch_size=8))
    return trainer.global_step


def _shown(page: Any, run_id: str) -> None:
    """Select `run_id` in the run list and wait until the page shows it finished, with a loss
    point per step on each rank."""
    page.click(f'#run-list li[data-run-id="{run_id}"]')
    page.wait_for_function(
        """([runId, steps, world]) => {
            const run = document.getElementById('run');
            const cards = [...document.querySelectorAll('#ranks .rank')];
            return run.dataset.runId === runId && run.dataset.status === 'finished'
                && cards.length === world
                && cards.every(card => card.dataset.status === 'finished'
                    && card.querySelector('canvas[data-chart="loss"]').dataset.points
                       === String(steps));
        }""",
        arg=[run_id, STEPS, WORLD],
        timeout=20_000,
    )


def _told_apart(page: Any, wrapper_id: str, booster_id: str, lightning_id: str) -> None:
    """Each run's entry in the runs list names its front door and script; the named run its
    name, above its id."""
    shown = page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('#run-list li')].map(li =>
            [li.dataset.runId, {text: li.innerText, entry: li.dataset.entryPoint,
                                name: li.querySelector('.run-name').hidden ? '' : li.innerText
                                    .split('\\n')[0]}]))"""
    )
    script = os.path.basename(sys.argv[0])
    expected = {
        wrapper_id: ("zero_optim_wrapper", ""),
        booster_id: ("Booster GeminiPlugin", RUN_NAME),
        lightning_id: ("Lightning GeminiStrategy", ""),
    }
    for run_id, (entry, name) in expected.items():
        seen = shown[run_id]
        assert (seen["entry"], seen["name"]) == (entry, name), shown
        assert f"{entry} · {script}" in seen["text"] and run_id in seen["text"], shown


def test_every_entry_point_appears_in_the_browser_with_nothing_in_the_script(
    tmp_path: Path,
) -> None:
    from playwright.sync_api import sync_playwright

    server = Server(tmp_path / "runs.sqlite")
    try:
        with sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page, errors = page_recording_errors(browser)
            page.goto(server.url + "/")
            page.wait_for_selector('#connection[data-state="live"]', timeout=15_000)

            wrapper_ids = run_ranks(_zero_optim_wrapper_run, WORLD, server.url, timeout_s=120)
            booster = run_ranks(_booster_run, WORLD, server.url, timeout_s=120)
            booster_ids, said = [b[0] for b in booster], [b[1] for b in booster]
            steps = run_ranks(_lightning_run, WORLD, server.url, timeout_s=180)
            assert steps == [STEPS] * WORLD
            for ids in (wrapper_ids, booster_ids):
                assert len(set(ids)) == 1  # one run, shared by the ranks

            page.wait_for_function(
                "() => document.querySelectorAll('#run-list li').length === 3", timeout=20_000
            )
            listed = page.evaluate(
                "() => [...document.querySelectorAll('#run-list li')].map(li => li.dataset.runId)"
            )
            lightning_ids = set(listed) - {wrapper_ids[0], booster_ids[0]}
            assert len(lightning_ids) == 1, listed
            for run_id in (wrapper_ids[0], booster_ids[0], *lightning_ids):
                _shown(page, run_id)
            _told_apart(page, wrapper_ids[0], booster_ids[0], lightning_ids.pop())
            # Rank 0 printed the run's page as it started (the other rank nothing): it opens it.
            printed = re.findall(r"goes to (\S+)", said[0])
            assert printed == [f"{server.url}/#run={booster_ids[0]}"] and not said[1], said
            page.goto(printed[0])
            page.wait_for_function(
                """([id, name]) => document.getElementById('run').dataset.runId === id
                    && document.getElementById('run-title').textContent === name""",
                arg=[booster_ids[0], RUN_NAME],
                timeout=15_000,
            )
            facts = page.evaluate(
                """() => Object.fromEntries([...document.querySelectorAll('#run-facts div')]
                    .map(row => [row.querySelector('dt').textContent,
                                 row.querySelector('dd').textContent]))"""
            )
            assert facts["run id"] == booster_ids[0], facts
            assert facts["entry point"] == "Booster GeminiPlugin", facts
            assert facts["script"] == sys.argv[0], facts
            browser.close()
    finally:
        server.stop()
    assert not errors, errors
