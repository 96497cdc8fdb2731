"""Delivery at scale: gzip bodies, batching in time, one sender per node."""

from __future__ import annotations

import gzip
import json
import os
import socket
import sqlite3
import struct
import threading
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_support import Server, free_port, step_event
from fastapi.testclient import TestClient
from helpers import OkResponse

from shardwise.telemetry import HttpSink, TelemetryEmitter, sinks
from shardwise_dashboard.app import create_app
from shardwise_dashboard.settings import Settings
from shardwise_dashboard.storage import RunStore

LIMIT = 64 * 1024


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(db_path=tmp_path / "runs.sqlite", max_body_bytes=LIMIT)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def _post_raw(client: TestClient, body: bytes, encoding: str = "gzip") -> Any:
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    return client.post("/api/v1/events", content=body, headers=headers)


def test_gzip_bodies_are_inflated_and_bounded(client: TestClient) -> None:
    events = [step_event(step=s) for s in range(100)]  # ~45 KB of JSON, ~3 KB gzipped
    body = json.dumps({"events": events}).encode()
    response = _post_raw(client, gzip.compress(body))
    assert response.status_code == 200 and response.json() == {"accepted": 100}
    assert client.get("/api/v1/runs/run-a").json()["ranks"][0]["steps"] == events
    # Small on the wire, over the limit once inflated: refused before it is parsed.
    bomb = gzip.compress(b'{"events": [' + b" " * (4 * LIMIT) + b"]}")
    assert len(bomb) < LIMIT
    assert _post_raw(client, bomb).status_code == 413
    assert _post_raw(client, gzip.compress(body)[:-20]).status_code == 400  # truncated
    assert _post_raw(client, b"not gzip at all").status_code == 400
    assert _post_raw(client, body, encoding="br").status_code == 415
    assert client.get("/api/v1/health").json()["num_events"] == 100


class _CountingSink:
    def __init__(self) -> None:
        self.batches: list[int] = []

    def write(self, events: list[dict[str, Any]]) -> None:
        self.batches.append(len(events))

    def close(self) -> None:
        pass


def test_the_emitter_sends_at_most_one_batch_per_interval_and_flushes_at_close() -> None:
    sink = _CountingSink()
    # A node waits half to all of the interval: at least 1 s here, longer than the emitting.
    emitter = TelemetryEmitter(sink, run_id="r", rank=0, flush_interval_s=2.0)
    for step in range(20):  # 20 steps at 40 steps/s: half a second
        emitter.emit(step_event(step=step))
        time.sleep(0.025)
    began = time.perf_counter()
    emitter.close()
    closed_in = time.perf_counter() - began
    assert sink.batches == [20], sink.batches
    assert closed_in < 0.5  # closing sends at once, it does not wait out the interval


def _node_sinks(
    url: str, monkeypatch: pytest.MonkeyPatch, ranks: int
) -> tuple[HttpSink, list[HttpSink]]:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    monkeypatch.setenv("MASTER_ADDR", f"test-{free_port()}")  # this test's own meeting point
    monkeypatch.setenv("LOCAL_RANK", "0")
    relay = HttpSink(url)
    peers = []
    for local_rank in range(1, ranks):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        peers.append(HttpSink(url))
    return relay, peers


def test_a_node_s_ranks_share_one_sender(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = Server(tmp_path / "runs.sqlite")
    try:
        relay, peers = _node_sinks(server.url, monkeypatch, ranks=4)
        sinks = [relay, *peers]
        failures: list[BaseException] = []

        def rank(local_rank: int) -> None:
            try:
                for step in range(5):
                    sinks[local_rank].write([step_event("node", local_rank, step)])
                    time.sleep(0.05)
            except BaseException as error:
                failures.append(error)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not failures, failures
        # Every write was acknowledged after the dashboard stored it, and only the node's
        # sender posted: the 20 batches went in far fewer requests.
        store = RunStore(tmp_path / "runs.sqlite")
        assert store.count_events("node") == 20
        assert all(peer.posts == 0 for peer in peers)
        assert 5 <= relay.posts < 20, relay.posts
        # The node's sender finishes first: the others post directly from then on.
        relay.close()
        peers[0].write([step_event("node", 1, 99)])
        assert peers[0].posts == 1 and store.count_events("node") == 21
        store.close()
        for peer in peers:
            peer.close()
    finally:
        server.stop()


def test_a_batch_the_dashboard_did_not_take_is_an_error_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    relay, (peer,) = _node_sinks(f"http://127.0.0.1:{free_port()}", monkeypatch, ranks=2)
    try:
        with pytest.raises(ConnectionError):
            peer.write([step_event("lost", 1, 0)])  # counted as dropped by its emitter
        with pytest.raises(ConnectionError):
            relay.write([step_event("lost", 0, 0)])
        assert peer.posts == 0  # it was not sent twice
    finally:
        relay.close()
        peer.close()


def test_a_sink_waits_out_a_locked_database_once(tmp_path: Path) -> None:
    db = tmp_path / "runs.sqlite"
    server = Server(db)  # its writes wait 1 s for a lock, then answer 503, Retry-After: 1
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        # Released while the second attempt waits on it: between 2 s (one busy timeout and
        # one Retry-After) and 3 s (two busy timeouts and one Retry-After) after the first.
        release = threading.Timer(2.5, holder.execute, args=("ROLLBACK",))
        release.start()
        sink = HttpSink(server.url, share_node=False, timeout_s=5.0)
        began = time.perf_counter()
        sink.write([step_event("locked", 0, 0)])  # 503 after 1 s; again 1 s later: stored
        waited = time.perf_counter() - began
        release.join()
        assert sink.posts == 2 and 2.0 < waited < 6.0, (sink.posts, waited)
        store = RunStore(db)
        assert store.count_events("locked") == 1
        store.close()
    finally:
        holder.close()
        server.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_the_node_s_sender_takes_batches_from_its_own_user_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    relay, (peer,) = _node_sinks(f"http://127.0.0.1:{free_port()}", monkeypatch, ranks=2)
    address = peer._peer.address  # type: ignore[union-attr]
    payload = json.dumps([step_event("intruder", 1, 0)]).encode()
    child = os.fork()
    if child == 0:  # another user of the machine: answered (0), shut out (1), or (2) neither
        code = 2
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as intruder:
                intruder.settimeout(5)
                intruder.connect(address)
                try:
                    intruder.sendall(struct.pack("!I", len(payload)) + payload)
                    code = 0 if intruder.recv(1) else 1
                except (ConnectionResetError, BrokenPipeError):
                    code = 1
        finally:
            os._exit(code)
    try:
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 1  # the connection closed, no answer
    finally:
        relay.close()
        peer.close()


def test_a_dashboard_without_gzip_gets_plain_bodies_from_then_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[str | None] = []

    def urlopen(request: Any, timeout: float) -> OkResponse:
        encoding = request.get_header("Content-encoding")
        sent.append(encoding)
        if encoding == "gzip":  # as a dashboard from before gzip answers: not JSON
            raise urllib.error.HTTPError(request.full_url, 422, "Unprocessable", {}, None)  # type: ignore[arg-type]
        return OkResponse()

    monkeypatch.setattr(sinks.urllib.request, "urlopen", urlopen)
    sink = HttpSink("http://127.0.0.1:1", share_node=False, compress_min_bytes=1024)
    big = [step_event(step=s) for s in range(20)]  # ~9 KB
    sink.write(big)
    sink.write(big)
    assert sent == ["gzip", None, None]
