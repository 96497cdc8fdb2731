"""The dashboard's HTTP API through FastAPI's test client: ingestion, validation, history,
the live stream, restarts."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_support import (
    chunks_event,
    eval_event,
    finished_event,
    started_event,
    step_event,
)
from fastapi.testclient import TestClient

from shardwise_dashboard.app import create_app
from shardwise_dashboard.settings import Settings

MAX_BODY = 64 * 1024


def make_client(db: Path, token: str | None = None) -> TestClient:
    return TestClient(create_app(Settings(db_path=db, token=token, max_body_bytes=MAX_BODY)))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with make_client(tmp_path / "runs.sqlite") as test_client:
        yield test_client


def post(client: TestClient, events: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.post("/api/v1/events", json={"events": events}, **kwargs)


def a_run(run_id: str = "run-a", steps: int = 3) -> list[dict[str, Any]]:
    events = []
    for rank in range(2):
        events.append(started_event(run_id, rank))
        events += [step_event(run_id, rank, s, loss=1.0 + rank + s / 8) for s in range(steps)]
        events.append(chunks_event(run_id, rank, 0))
        events.append(finished_event(run_id, rank))
    return events


def assert_healthy_and_empty(client: TestClient) -> None:
    health = client.get("/api/v1/health").json()
    assert health["status"] == "ok" and health["num_events"] == 0
    assert client.get("/api/v1/runs").json() == []


def test_a_valid_batch_is_stored_and_described(client: TestClient) -> None:
    response = post(client, a_run())
    assert response.status_code == 200, response.text
    assert response.json() == {"accepted": 12}
    (summary,) = client.get("/api/v1/runs").json()
    assert summary["run_id"] == "run-a" and summary["status"] == "finished"
    assert (summary["world_size"], summary["ranks_seen"], summary["ranks_finished"]) == (2, 2, 2)
    assert (summary["last_step"], summary["num_params"]) == (2, 1234)
    detail = client.get("/api/v1/runs/run-a").json()
    assert detail["config"] == {"stage": 3, "chunks": 2}
    for rank, rank_detail in enumerate(detail["ranks"]):
        assert rank_detail["rank"] == rank and rank_detail["status"] == "finished"
        assert [e["step"] for e in rank_detail["steps"]] == [0, 1, 2]
        assert [e["loss"] for e in rank_detail["steps"]] == [1.0 + rank + s / 8 for s in range(3)]
        assert rank_detail["chunks"] == chunks_event("run-a", rank, 0)
        assert rank_detail["host"] == "node-0"


def test_a_run_is_running_until_every_rank_finished(client: TestClient) -> None:
    events = a_run()
    post(client, [e for e in events if not (e["type"] == "run_finished" and e["rank"] == 1)])
    assert client.get("/api/v1/runs").json()[0]["status"] == "running"
    failed = {**finished_event("run-a", 1), "status": "failed", "error": "rank 1: out of memory"}
    post(client, [failed])
    detail = client.get("/api/v1/runs/run-a").json()
    assert detail["status"] == "failed"
    assert detail["ranks"][1]["error"] == "rank 1: out of memory"


def test_a_run_joined_midway_finishes_when_every_rank_seen_finished(client: TestClient) -> None:
    # The dashboard came up after the ranks started: no run_started, world size unknown.
    post(client, [step_event(rank=r, step=5) for r in (0, 1)] + [finished_event(rank=0)])
    assert client.get("/api/v1/runs").json()[0]["status"] == "running"
    post(client, [finished_event(rank=1)])
    (summary,) = client.get("/api/v1/runs").json()
    assert (summary["status"], summary["world_size"], summary["ranks_seen"]) == (
        "finished",
        None,
        2,
    )


def test_malformed_json_is_refused_and_the_server_stays_healthy(client: TestClient) -> None:
    for body in (b'{"events": [', b"not json", b"", b'{"events": "step"}', b"[]"):
        response = client.post(
            "/api/v1/events", content=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 422, (body, response.text)
    assert_healthy_and_empty(client)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"step": "1"}, "step"),
        ({"loss": "low"}, "loss"),
        ({"overflow": 1}, "overflow"),
        ({"rank": -1}, "rank"),
        ({"step_time_s": -0.5}, "step_time_s"),
        ({"comm_bytes": {"all_gather": 1.5}}, "comm_bytes"),
        ({"memory": {"device": 1}}, "memory"),
        ({"run_id": ""}, "run_id"),
        ({"type": "reboot"}, "type"),
        ({"surprise": True}, "surprise"),
        ({"step": 2**70}, "step"),
        ({"run_id": "\ud800"}, "run_id"),
    ],
)
def test_wrong_fields_are_refused_whole(
    client: TestClient, change: dict[str, Any], where: str
) -> None:
    # One bad event refuses the batch: the good one beside it is not stored either.
    body = json.dumps({"events": [step_event(step=0), {**step_event(step=1), **change}]})
    response = client.post(
        "/api/v1/events", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert where in json.dumps(response.json()["detail"])
    assert_healthy_and_empty(client)


@pytest.mark.parametrize(
    ("field", "literal"), [("loss", "NaN"), ("time", "Infinity"), ("loss_scale", "-Infinity")]
)
def test_non_json_numbers_are_refused(client: TestClient, field: str, literal: str) -> None:
    # Python's JSON parser reads these words; the schema has no place for them.
    body = json.dumps({"events": [{**step_event(), field: "@"}]}).replace('"@"', literal)
    response = client.post(
        "/api/v1/events", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422 and field in response.text
    started = json.dumps({"events": [started_event()]}).replace('"chunks": 2', '"chunks": NaN')
    response = client.post(
        "/api/v1/events", content=started, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 422 and "config must be plain JSON" in response.text
    assert_healthy_and_empty(client)


def test_a_bad_chunk_row_is_refused(client: TestClient) -> None:
    event = chunks_event()
    event["chunks"][1]["payload"] = "disk"
    response = post(client, [event])
    assert response.status_code == 422 and "payload" in response.text
    event = chunks_event()
    event["chunks"][0]["tensor_states"] = {"\ud800": 1}  # a lone surrogate, as JSON can say
    response = client.post(
        "/api/v1/events",
        content=json.dumps({"events": [event]}),
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 422 and "tensor_states" in response.text
    assert_healthy_and_empty(client)


def test_another_schema_version_is_refused_by_name(client: TestClient) -> None:
    response = post(client, [step_event(schema=2)])
    assert response.status_code == 422
    assert "schema version 2 is not supported" in response.text
    assert_healthy_and_empty(client)


def test_an_oversized_body_is_refused(client: TestClient) -> None:
    many = [step_event(step=s) for s in range(300)]
    assert len(json.dumps({"events": many}, separators=(",", ":"))) > MAX_BODY
    assert post(client, many).status_code == 413

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"events": ['
        for s in range(299):
            yield json.dumps(step_event(step=s)).encode() + b","
        yield json.dumps(step_event(step=299)).encode() + b"]}"

    response = client.post(
        "/api/v1/events", content=chunked(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert_healthy_and_empty(client)
    assert post(client, many[:100]).status_code == 200


def test_a_token_guards_ingestion_when_set(tmp_path: Path) -> None:
    with make_client(tmp_path / "runs.sqlite", token="s3cret") as client:
        missing = post(client, a_run())
        assert missing.status_code == 401 and "SHARDWISE_DASHBOARD_TOKEN" in missing.text
        wrong = post(client, a_run(), headers={"Authorization": "Bearer guess"})
        assert wrong.status_code == 403
        basic = post(client, a_run(), headers={"Authorization": "Basic s3cret"})
        assert basic.status_code == 401
        assert_healthy_and_empty(client)
        right = post(client, a_run(), headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200
        assert client.get("/api/v1/runs").json()[0]["run_id"] == "run-a"


def test_history_can_be_thinned_without_losing_overflows(client: TestClient) -> None:
    events = [
        step_event(rank=r, step=s, overflow=s in (13, 57)) for r in (0, 1) for s in range(100)
    ]
    for half in (events[:100], events[100:]):  # each under the test server's body limit
        assert post(client, half).status_code == 200
    full = client.get("/api/v1/runs/run-a").json()["ranks"]
    assert [len(rank["steps"]) for rank in full] == [100, 100]
    thin = client.get("/api/v1/runs/run-a?max_points=10").json()["ranks"]
    for rank in thin:
        steps = [e["step"] for e in rank["steps"]]
        assert steps == sorted({*range(0, 100, 10), 13, 57, 99})
        assert [e["step"] for e in rank["steps"] if e["overflow"]] == [13, 57]
    assert client.get("/api/v1/runs/run-a?max_points=1").status_code == 422


def test_evaluations_are_stored_and_served_per_rank(client: TestClient) -> None:
    events = []
    for rank in (0, 1):
        events += [step_event(rank=rank, step=s) for s in range(100)]
        # Every 10 steps, sent after the step (as the ranks do) and once out of order; one
        # evaluation lost its loss (not finite on the rank: null).
        evals = [eval_event(rank=rank, step=s, loss=3.0 - s / 100) for s in range(9, 100, 10)]
        evals[4]["loss"] = None
        events += [evals[-1], *evals[:-1]]
    for half in (events[:110], events[110:]):  # each under the test server's body limit
        response = post(client, half)
        assert response.status_code == 200, response.text
    eval_steps = list(range(9, 100, 10))
    detail = client.get("/api/v1/runs/run-a").json()
    for rank, rank_detail in enumerate(detail["ranks"]):
        assert [e["step"] for e in rank_detail["evals"]] == eval_steps
        assert all(e["type"] == "eval" and e["rank"] == rank for e in rank_detail["evals"])
        losses = [e["loss"] for e in rank_detail["evals"]]
        assert losses == [None if s == 49 else 3.0 - s / 100 for s in eval_steps]
        assert len(rank_detail["steps"]) == 100  # evaluations are not steps
        assert rank_detail["num_steps"] == 100 and rank_detail["last_step"] == 99
    # Thinned with the steps: every k-th evaluation by position, and the latest.
    thin = client.get("/api/v1/runs/run-a?max_points=4").json()["ranks"]
    assert [[e["step"] for e in r["evals"]] for r in thin] == [[9, 39, 69, 99]] * 2
    one = client.get("/api/v1/runs/run-a?rank=1").json()["ranks"]
    assert [r["rank"] for r in one] == [1] and len(one[0]["evals"]) == 10
    # A run that never evaluated has none.
    post(client, a_run("run-b"))
    assert all(r["evals"] == [] for r in client.get("/api/v1/runs/run-b").json()["ranks"])


@pytest.mark.parametrize(
    ("change", "where"),
    [({"loss": "low"}, "loss"), ({"step": -1}, "step"), ({"epoch": 2}, "epoch")],
)
def test_a_bad_evaluation_is_refused_whole(
    client: TestClient, change: dict[str, Any], where: str
) -> None:
    response = post(client, [step_event(step=0), {**eval_event(), **change}])
    assert response.status_code == 422 and where in json.dumps(response.json()["detail"])
    assert_healthy_and_empty(client)


def test_any_run_id_can_be_read_back(client: TestClient) -> None:
    for run_id in ("team/exp 1", "ünï-cødé", "a?b#c"):
        post(client, [step_event(run_id)])
        quoted = urllib.parse.quote(run_id, safe="")  # as the page's encodeURIComponent
        detail = client.get(f"/api/v1/runs/{quoted}").json()
        assert detail["run_id"] == run_id and detail["ranks"][0]["steps"][0]["run_id"] == run_id


def test_an_unknown_run_is_404(client: TestClient) -> None:
    response = client.get("/api/v1/runs/nope")
    assert response.status_code == 404 and "nope" in response.text


def _read_stream(client: TestClient, query: str, out: dict[str, str]) -> None:
    out["body"] = client.get(f"/api/v1/stream?{query}").text


def _wait_for_streams(client: TestClient, count: int) -> None:
    deadline = time.monotonic() + 10
    while client.get("/api/v1/health").json()["num_streams"] < count:
        assert time.monotonic() < deadline, "the stream never subscribed"
        time.sleep(0.01)


def _messages(body: str) -> list[tuple[str, Any]]:
    messages = []
    for block in body.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in fields:
            messages.append((fields["event"], json.loads(fields["data"])))
    return messages


def test_the_live_stream_delivers_ingested_events(client: TestClient) -> None:
    every, one_run = {}, {}
    readers = [
        threading.Thread(target=_read_stream, args=(client, "limit=2", every)),
        threading.Thread(target=_read_stream, args=(client, "run_id=run-b&limit=1", one_run)),
    ]
    for reader in readers:
        reader.start()
    _wait_for_streams(client, 2)
    first, second = step_event("run-a", step=0), step_event("run-b", rank=1, step=7)
    assert post(client, [first]).status_code == 200
    assert post(client, [second]).status_code == 200
    for reader in readers:
        reader.join(10)
        assert not reader.is_alive()
    assert _messages(every["body"]) == [
        ("hello", {}),
        ("events", [first]),
        ("events", [second]),
    ]
    assert _messages(one_run["body"]) == [("hello", {}), ("events", [second])]
    assert client.get("/api/v1/health").json()["num_streams"] == 0


def test_a_restart_on_the_same_file_keeps_history(tmp_path: Path) -> None:
    db = tmp_path / "runs.sqlite"
    with make_client(db) as client:
        post(client, a_run("run-a"))
        post(client, a_run("run-b", steps=5))
        before = (client.get("/api/v1/runs").json(), client.get("/api/v1/runs/run-b").json())
    with make_client(db) as client:
        after = (client.get("/api/v1/runs").json(), client.get("/api/v1/runs/run-b").json())
        assert after == before
        assert {run["run_id"] for run in after[0]} == {"run-a", "run-b"}
        assert client.get("/api/v1/health").json()["num_events"] == 12 + 16


def test_openapi_describes_every_endpoint(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert set(spec["paths"]) == {
        "/",
        "/api/v1/events",
        "/api/v1/runs",
        "/api/v1/runs/{run_id}",
        "/api/v1/overview/{run_id}",
        "/api/v1/placement/{run_id}",
        "/api/v1/stream",
        "/api/v1/health",
    }
    ingest = spec["paths"]["/api/v1/events"]["post"]
    body = ingest["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/EventBatch")
    assert {"200", "401", "403", "413", "422", "503"} <= set(ingest["responses"])
    assert (
        "text/event-stream" in spec["paths"]["/api/v1/stream"]["get"]["responses"]["200"]["content"]
    )
    assert {
        "RunStarted",
        "Step",
        "Chunks",
        "RunFinished",
        "Dropped",
        "Eval",
        "RunDetail",
        "PlacementTimeline",
    } <= set(spec["components"]["schemas"])


def test_the_page_and_its_assets_are_served_from_the_package(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert "default-src 'self'" in page.headers["content-security-policy"]
    links = re.findall(r'(?:src|href)="([^"]*)"', page.text)
    assert {"/static/app.js", "/static/style.css"} <= set(links)
    assert all(link.startswith(("/static/", "data:")) for link in links), links  # no CDN
    modules: set[str] = set()
    importing = ["app.js"]
    while importing:  # the modules app.js imports, and theirs
        script = client.get(f"/static/{importing.pop()}").text
        found = set(re.findall(r'from "\./([a-z]+\.js)"', script)) - modules
        modules |= found
        importing += sorted(found)
    assert modules == {"charts.js", "chunkmap.js", "overview.js", "rank.js", "timeline.js"}
    for module in [*modules, "style.css"]:
        response = client.get(f"/static/{module}")
        assert response.status_code == 200 and len(response.text) > 100, module


def test_the_overview_lists_only_ranks_that_stand_out(client: TestClient) -> None:
    post(client, a_run())  # two ranks alike
    alike = client.get("/api/v1/overview/run-a").json()
    assert alike["rank_status"] == {"finished": 2} and alike["steps"]["ranks"] == [2, 2, 2]
    assert alike["outliers"] == []  # nothing at 1.00x the median
    # Rank 1 a few percent slower than the median over the window: not listed either.
    post(client, [step_event("run-a", 0, 3, step_time_s=0.113)])
    post(client, [step_event("run-a", 1, 3, step_time_s=0.137)])
    assert client.get("/api/v1/overview/run-a").json()["outliers"] == []
    post(client, [step_event("run-a", 1, 4, step_time_s=0.5)])  # rank 1 slows down
    slow = client.get("/api/v1/overview/run-a").json()["outliers"]
    assert [(o["kind"], o["rank"]) for o in slow] == [("slowest", 1)], slow
    assert slow[0]["value"] >= 1.1 * slow[0]["median"], slow
    assert client.get("/api/v1/overview/run-a?since_step=2").json()["steps"]["step"] == [3, 4]
