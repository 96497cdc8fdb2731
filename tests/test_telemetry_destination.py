"""A dashboard URL without http://, one that is no URL at all, and a dashboard that does not
answer: none stops or slows training, and each is said once, at the start, as a warning on rank
0 (a log record of "shardwise.telemetry", never an exception)."""

from __future__ import annotations

import http.server
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, make_model

from shardwise import telemetry, zero_model_wrapper, zero_optim_wrapper
from shardwise.telemetry.destination import dashboard_url
from shardwise.testing import run_ranks

STEPS = 3


@pytest.mark.parametrize(
    ("given", "taken", "said"),
    [
        ("http://127.0.0.1:8265", "http://127.0.0.1:8265", ""),
        (" https://dash.example:443/ ", "https://dash.example:443/", ""),
        ("127.0.0.1:8265", "http://127.0.0.1:8265", "taken as http://127.0.0.1:8265"),
        ("localhost:8300", "http://localhost:8300", "taken as http://localhost:8300"),
        ("[::1]:8265", "http://[::1]:8265", "taken as http://[::1]:8265"),
        ("htp:/127.0.0.1:8265", None, "not an http:// or https:// address"),
        ("ftp://127.0.0.1:8265", None, "not an http:// or https:// address"),
        ("http://", None, "not an http:// or https:// address"),
        ("http://127.0.0.1:port", None, "not an http:// or https:// address"),
    ],
)
def test_a_dashboard_url_is_taken_or_refused_in_one_warning(
    given: str, taken: str | None, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="shardwise.telemetry"):
        assert dashboard_url(given, speak=False) == taken  # other ranks: the same, silently
        assert dashboard_url(given, speak=True) == taken
        assert dashboard_url(given, speak=True) == taken  # asked again: said once
    messages = [record.getMessage() for record in caplog.records]
    if said:
        assert len(messages) == 1 and said in messages[0], messages
        assert taken is not None or "training goes on" in messages[0], messages
    else:
        assert messages == [], messages


class _Dashboard(http.server.BaseHTTPRequestHandler):
    """Stands in for the dashboard: health answers, event batches are kept."""

    received: ClassVar[list[dict[str, Any]]] = []

    def do_GET(self) -> None:
        self._answer(b'{"status": "ok"}')

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Dashboard.received += json.loads(body)["events"]
        self._answer(b'{"accepted": 1}')

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def dashboard() -> Iterator[int]:
    """A stand-in dashboard on a free loopback port (its port)."""
    _Dashboard.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Dashboard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.levelname, record.getMessage()))


def _train(url: str) -> dict[str, Any]:
    """STEPS steps through `zero_optim_wrapper` with SHARDWISE_DASHBOARD_URL=`url`: what the
    telemetry logger said by the end of the first step (the start) and by the end, and the step
    times."""
    os.environ["SHARDWISE_DASHBOARD_URL"] = url  # this rank's process only
    os.environ["SHARDWISE_TELEMETRY_SHARE_NODE"] = "0"
    records = _Records()
    logger = logging.getLogger("shardwise.telemetry")
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    rank = dist.get_rank()
    model = make_model()
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL}
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    recorder = telemetry.enable(wrapped, optimizer)
    step_times = []
    at_start: list[tuple[str, str]] = []
    for step in range(STEPS):
        began = time.perf_counter()
        optimizer.zero_grad()
        optimizer.backward(wrapped(*batch_slice(step, 0, rank, 2)))
        optimizer.step()
        step_times.append(time.perf_counter() - began)
        if step == 0:
            if recorder is not None:
                recorder.emitter.checked.wait(10)  # the delivery thread asked the dashboard
            at_start = list(records.seen)
    if recorder is not None:
        recorder.finish()
    logger.removeHandler(records)
    return {
        "streamed": recorder is not None,
        "steps": len(step_times),
        "at_start": at_start,
        "at_end": records.seen,
    }


def _warnings(seen: list[tuple[str, str]]) -> list[str]:
    return [message for level, message in seen if level == "WARNING"]


def test_a_url_without_http_still_streams_and_is_said_once(dashboard: int) -> None:
    results = run_ranks(_train, 2, f"127.0.0.1:{dashboard}")
    assert [r["steps"] for r in results] == [STEPS, STEPS] and results[0]["streamed"]
    said = _warnings(results[0]["at_start"])
    assert len(said) == 1 and f"taken as http://127.0.0.1:{dashboard}" in said[0], said
    assert _warnings(results[0]["at_end"]) == said  # nothing more by the end
    assert _warnings(results[1]["at_end"]) == []  # the other rank says nothing
    steps = [e for e in _Dashboard.received if e["type"] == "step"]
    assert sorted((e["rank"], e["step"]) for e in steps) == [
        (rank, step) for rank in range(2) for step in range(STEPS)
    ]


def test_a_url_that_is_none_trains_without_telemetry_and_is_said_once() -> None:
    results = run_ranks(_train, 2, "htp:/localhost:8265")  # a URL no other test gave
    assert [(r["steps"], r["streamed"]) for r in results] == [(STEPS, False)] * 2
    said = _warnings(results[0]["at_start"])
    assert len(said) == 1 and "'htp:/localhost:8265'" in said[0], said
    assert "training goes on" in said[0]
    assert _warnings(results[0]["at_end"]) == said and _warnings(results[1]["at_end"]) == []


def test_a_dashboard_that_does_not_answer_is_said_at_the_start() -> None:
    url = f"http://127.0.0.1:{_unused_port()}"
    results = run_ranks(_train, 2, url)
    assert [r["steps"] for r in results] == [STEPS, STEPS]
    said = _warnings(results[0]["at_start"])
    assert len(said) == 1 and f"the dashboard at {url} does not answer" in said[0], said
    # By the end rank 0 has said nothing more as a warning: the count of dropped events is
    # logged below it.
    assert _warnings(results[0]["at_end"]) == said
    assert any("could not be delivered" in m for _, m in results[0]["at_end"])
    assert _warnings(results[1]["at_start"]) == []
