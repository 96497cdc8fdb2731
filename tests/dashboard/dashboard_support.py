"""Shared by the dashboard tests: events of schema v1, and a real server in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest


def step_event(
    run_id: str = "run-a", rank: int = 0, step: int = 0, **changes: Any
) -> dict[str, Any]:
    event = {
        "schema": 1,
        "type": "step",
        "run_id": run_id,
        "rank": rank,
        "time": 1_700_000_000.0 + step,
        "step": step,
        "loss": 2.5 - 0.1 * step,
        "loss_scale": 65536.0,
        "overflow": False,
        "grad_norm": 0.75,
        "step_time_s": 0.125,
        "comm_bytes": {"all_gather": 4096, "reduce_scatter": 2048},
        "comm_bytes_unquantized": {"all_gather": 4096, "reduce_scatter": 2048},
        "moved_bytes": {"to_device": 0, "to_host": 0, "to_disk": 0, "from_disk": 0},
        "memory": {"device": 1 << 20, "host": 0, "disk": 0},
        "skipped_in_a_row": 0,
        "warning": None,
    }
    event.update(changes)
    return event


def started_event(
    run_id: str = "run-a", rank: int = 0, world_size: int = 2, **changes: Any
) -> dict[str, Any]:
    event = {
        "schema": 1,
        "type": "run_started",
        "run_id": run_id,
        "rank": rank,
        "time": 1_700_000_000.0,
        "world_size": world_size,
        "config": {"stage": 3, "chunks": 2},
        "num_params": 1234,
        "host": "node-0",
    }
    event.update(changes)
    return event


def chunks_event(run_id: str = "run-a", rank: int = 0, step: int = 0) -> dict[str, Any]:
    return {
        "schema": 1,
        "type": "chunks",
        "run_id": run_id,
        "rank": rank,
        "time": 1_700_000_000.5,
        "step": step,
        "chunks": [
            {
                "id": i,
                "numel": 3001,
                "state": "sharded",
                "sharded": True,
                "payload": "device",
                "optim": "host" if i else None,
                "tensor_states": {"free": 3},
            }
            for i in range(2)
        ],
    }


def eval_event(
    run_id: str = "run-a", rank: int = 0, step: int = 0, loss: float | None = 2.0
) -> dict[str, Any]:
    return {
        "schema": 1,
        "type": "eval",
        "run_id": run_id,
        "rank": rank,
        "time": 1_700_000_000.75 + step,
        "step": step,
        "loss": loss,
    }


def finished_event(run_id: str = "run-a", rank: int = 0) -> dict[str, Any]:
    return {
        "schema": 1,
        "type": "run_finished",
        "run_id": run_id,
        "rank": rank,
        "time": 1_700_000_100.0,
        "status": "finished",
        "error": None,
    }


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
]


def launch_chromium(playwright: Any) -> Any:
    """Debian's headless chromium under Playwright; a missing browser fails the test, loudly."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the dashboard's browser tests drive Debian's chromium; "
            "`./dev test` installs it (apt-get install chromium)"
        )
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)


def page_recording_errors(browser: Any, width: int = 1400) -> tuple[Any, list[str]]:
    """A new page of `browser` (width x 1000) and the list its uncaught script errors go to."""
    page = browser.new_page(viewport={"width": width, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    return page, errors


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """`python -m shardwise_dashboard serve` on a free loopback port, as a user starts it."""

    def __init__(self, db: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardwise_dashboard",
                "serve",
                "--port",
                str(self.port),
                "--db",
                str(db),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(self.url + "/api/v1/health", timeout=1):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"dashboard did not start: {self.output()}") from None
                time.sleep(0.05)

    def output(self) -> str:
        return (
            self.process.stdout.read()
            if self.process.stdout and self.process.poll() is not None
            else ""
        )

    def kill(self) -> None:
        """SIGKILL: the dashboard vanishes mid-request, as in a crash."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self.process.stdout:
            self.process.stdout.close()


def post_events(url: str, events: list[dict[str, Any]], timeout_s: float = 30.0) -> None:
    """POST one batch to a running dashboard at `url`, as a rank's sender does."""
    request = urllib.request.Request(
        url + "/api/v1/events",
        data=json.dumps({"events": events}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        assert response.status == 200
