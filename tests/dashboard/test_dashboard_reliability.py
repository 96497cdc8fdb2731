"""Reliability edges of the dashboard: bounded query parameters, a database it cannot use,
a database another process holds, runs whose ranks went silent, and the engine's skip
warning carried by step events."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_support import finished_event, free_port, started_event, step_event
from fastapi.testclient import TestClient

from shardwise_dashboard.app import create_app
from shardwise_dashboard.db_schema import DB_VERSION
from shardwise_dashboard.settings import Settings
from shardwise_dashboard.storage import RunStore

HUGE = "99999999999999999999"  # over 2**64: an OverflowError once it reaches SQLite


def post(client: TestClient, events: list[dict[str, Any]]) -> Any:
    return client.post("/api/v1/events", json={"events": events})


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(db_path=tmp_path / "runs.sqlite", stale_after_s=1.0, busy_timeout_s=0.2)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def _numeric_query_parameters(spec: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, methods in spec["paths"].items():
        for operation in methods.values():
            for parameter in operation.get("parameters", []):
                schema = parameter["schema"]
                options = schema.get("anyOf", [schema])
                numeric = [s for s in options if s.get("type") in ("integer", "number")]
                if parameter["in"] == "query" and numeric:
                    yield path, parameter["name"], numeric[0]


def test_every_numeric_query_parameter_is_bounded(client: TestClient) -> None:
    assert post(client, [step_event()]).status_code == 200
    checked = []
    for path, name, schema in _numeric_query_parameters(client.get("/openapi.json").json()):
        assert "maximum" in schema or "exclusiveMaximum" in schema, (path, name)
        url = path.replace("{run_id}", "run-a") + f"?{name}={HUGE}"
        if path.endswith("/stream"):
            url += "&run_id=none"  # were it accepted, it would stream forever: bounded below
        response = client.get(url)
        assert response.status_code == 422, (url, response.text)
        assert name in response.text
        checked.append((path, name))
    assert {
        ("/api/v1/runs/{run_id}", "max_points"),
        ("/api/v1/runs/{run_id}", "rank"),
        ("/api/v1/overview/{run_id}", "steps"),
        ("/api/v1/overview/{run_id}", "since_step"),
        ("/api/v1/stream", "limit"),
    } <= set(checked)


def _serve(db: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "shardwise_dashboard", "serve"]
    return subprocess.run(
        [*command, "--port", str(free_port()), "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=20,  # a server that started (wrongly) is stopped by this
    )


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[None]:
    """`path` read-only for the server: by its mode, or, for root (who may write any mode),
    with the immutable attribute."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        yield
        return
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("running as root, and chattr +i cannot make a file read-only here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def _assert_one_line_error(result: subprocess.CompletedProcess[str], db: Path, why: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no traceback, no usage text
    assert lines[0].startswith(f"shardwise-dashboard: error: cannot use {db} as the dashboard")
    assert why in lines[0] and "--db" in lines[0], lines[0]


def test_a_database_it_cannot_use_is_one_clear_line_at_start(tmp_path: Path) -> None:
    _assert_one_line_error(_serve(tmp_path), tmp_path, "it is a directory")
    garbage = tmp_path / "notes.txt"
    garbage.write_bytes(b"these are not the tables you are looking for\n" * 200)
    _assert_one_line_error(_serve(garbage), garbage, "file is not a database")
    readonly = tmp_path / "history.sqlite"
    RunStore(readonly).close()
    with _read_only(readonly):
        _assert_one_line_error(_serve(readonly), readonly, "readonly")


def test_a_locked_database_answers_503_with_retry_after(tmp_path: Path) -> None:
    db = tmp_path / "runs.sqlite"
    settings = Settings(db_path=db, busy_timeout_s=0.2)
    holder_code = (
        "import sqlite3, sys\n"
        f"db = sqlite3.connect({str(db)!r}, isolation_level=None)\n"
        "db.execute('BEGIN EXCLUSIVE')\n"
        "print('locked', flush=True)\n"
        "sys.stdin.readline()\n"
        "db.execute('ROLLBACK')\n"
    )
    with TestClient(create_app(settings)) as client:
        holder = subprocess.Popen(
            [sys.executable, "-c", holder_code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
            began = time.perf_counter()
            response = post(client, [step_event()])
            waited = time.perf_counter() - began
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            assert "locked by another process" in response.json()["detail"]
            assert waited < 2.0  # the busy timeout, not SQLite's default 5 s
            assert client.get("/api/v1/health").status_code == 200  # reading still works
        finally:
            assert holder.stdin is not None
            holder.stdin.write("\n")
            holder.stdin.close()
            holder.wait(10)
        assert post(client, [step_event()]).status_code == 200
        assert client.get("/api/v1/health").json()["num_events"] == 1  # the 503 stored nothing


def test_a_run_whose_ranks_went_silent_turns_stale(client: TestClient) -> None:
    now = [1e9]
    client.app.state.store.clock = lambda: now[0]  # type: ignore[attr-defined]  # the server's
    post(client, [started_event("quiet", r) for r in (0, 1)] + [step_event("quiet", 0, 0)])
    post(client, [*(started_event("done", r) for r in (0, 1)), finished_event("done", 0)])
    post(client, [finished_event("done", 1)])
    statuses = {run["run_id"]: run["status"] for run in client.get("/api/v1/runs").json()}
    assert statuses == {"quiet": "running", "done": "finished"}
    now[0] += 0.6
    post(client, [step_event("quiet", 1, 0)])  # rank 1 speaks; rank 0 goes on saying nothing
    now[0] += 0.6  # rank 0: 1.2 s of silence, over the fixture's 1 s; rank 1: 0.6 s
    detail = client.get("/api/v1/runs/quiet").json()
    assert detail["status"] == "running"
    assert [rank["status"] for rank in detail["ranks"]] == ["stale", "running"]
    now[0] += 0.5
    statuses = {run["run_id"]: run["status"] for run in client.get("/api/v1/runs").json()}
    assert statuses == {"quiet": "stale", "done": "finished"}  # a finished run never goes stale
    outliers = client.get("/api/v1/overview/quiet").json()["outliers"]
    (stale,) = [o for o in outliers if o["kind"] == "stale"]
    assert (stale["kind"], stale["rank"], stale["num_ranks"]) == ("stale", 0, 2)
    post(client, [step_event("quiet", 0, 1)])
    assert client.get("/api/v1/runs/quiet").json()["status"] == "running"


def test_step_events_of_older_senders_validate_and_warnings_are_kept(client: TestClient) -> None:
    old = step_event("skips", 0, 0)
    del old["skipped_in_a_row"], old["warning"]  # what a shardwise before the fields sends
    assert post(client, [old]).status_code == 200
    stored = client.get("/api/v1/runs/skips").json()["ranks"][0]["steps"][0]
    assert (stored["skipped_in_a_row"], stored["warning"]) == (0, None)
    text = "steps 3-6 skipped: gradients not finite 4 times in a row at the minimum loss scale"
    skipping = [
        step_event(
            "skips", r, s, overflow=True, skipped_in_a_row=s - 2, warning=text if s >= 6 else None
        )
        for r in (0, 1)
        for s in (3, 4, 5, 6)
    ]
    assert post(client, skipping).status_code == 200
    (summary,) = client.get("/api/v1/runs").json()
    assert summary["ranks_warned"] == 2
    ranks = client.get("/api/v1/runs/skips").json()["ranks"]
    assert [(r["warning"], r["warning_step"], r["skipped_in_a_row"]) for r in ranks] == [
        (text, 6, 4),
        (text, 6, 4),
    ]
    # The engine steps again: the count returns to 0, the warning stays on record.
    assert post(client, [step_event("skips", 0, 7)]).status_code == 200
    rank0 = client.get("/api/v1/runs/skips?rank=0").json()["ranks"]
    assert [(r["rank"], r["warning"], r["skipped_in_a_row"]) for r in rank0] == [(0, text, 0)]
    (warning,) = [
        o for o in client.get("/api/v1/overview/skips").json()["outliers"] if o["kind"] == "warning"
    ]
    assert (warning["text"], warning["num_ranks"], warning["step"]) == (text, 2, 6)
    assert warning["active"]  # rank 1 is still skipping


@pytest.mark.parametrize(
    "change",
    [{"skipped_in_a_row": -1}, {"skipped_in_a_row": "2"}, {"warning": "w" * 201}, {"warning": 5}],
)
def test_bad_skip_fields_are_refused(client: TestClient, change: dict[str, Any]) -> None:
    response = post(client, [step_event(**change)])
    assert response.status_code == 422 and next(iter(change)) in response.text


def test_a_version_1_history_file_is_migrated(tmp_path: Path) -> None:
    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as old:
        old.executescript(_VERSION_1_TABLES)
        old.executemany(
            "INSERT INTO events (run_id, rank, type, step, time, body) VALUES (?, ?, ?, ?, ?, ?)",
            [("v1", 0, "step", s, 1.0 + s, json.dumps(_v1_step(s))) for s in range(3)],
        )
        old.execute(
            "INSERT INTO runs VALUES ('v1', 1.0, 3.0, 1, 10, NULL)",
        )
        old.execute(
            "INSERT INTO ranks VALUES ('v1', 0, 'finished', NULL, 'h', 2, 3, 0, 3.0)",
        )
    with TestClient(create_app(Settings(db_path=db))) as client:
        (summary,) = client.get("/api/v1/runs").json()
        assert (summary["run_id"], summary["status"], summary["last_step"]) == ("v1", "finished", 2)
        (rank,) = client.get("/api/v1/runs/v1").json()["ranks"]
        assert [s["step"] for s in rank["steps"]] == [0, 1, 2] and rank["first_overflow"] == 1
        steps = client.get("/api/v1/overview/v1").json()["steps"]
        assert steps["step"] == [0, 1, 2] and steps["sent_bytes"]["max"] == [6144] * 3
    with sqlite3.connect(db) as migrated:
        assert migrated.execute("PRAGMA user_version").fetchone()[0] == DB_VERSION


def test_a_version_2_file_missing_an_index_gets_it_at_start(tmp_path: Path) -> None:
    # As written between two changes of the indexes at version 2: the overview, which names
    # its index, failed with a 500 on such a file.
    db = tmp_path / "runs.sqlite"
    RunStore(db).close()
    with sqlite3.connect(db) as early:
        early.executescript(
            "DROP INDEX step_metrics; DROP INDEX events_by_run;"
            "CREATE INDEX events_by_step ON events (run_id, type, step);"
        )
    with TestClient(create_app(Settings(db_path=db))) as client:
        assert post(client, [step_event(step=s) for s in range(3)]).status_code == 200
        response = client.get("/api/v1/overview/run-a")
        assert response.status_code == 200, response.text
        assert response.json()["steps"]["step"] == [0, 1, 2]
    with sqlite3.connect(db) as fixed:
        indexes = {row[0] for row in fixed.execute("SELECT name FROM sqlite_master")}
        assert {"step_metrics", "events_by_run"} <= indexes
        assert fixed.execute("PRAGMA user_version").fetchone()[0] == DB_VERSION


def _v1_step(step: int) -> dict[str, Any]:
    event = step_event("v1", 0, step, overflow=step == 1)
    del event["skipped_in_a_row"], event["warning"]
    return event


# The tables as version 1 of the dashboard wrote them.
_VERSION_1_TABLES = """
CREATE TABLE runs (run_id TEXT PRIMARY KEY, started REAL NOT NULL, last_seen REAL NOT NULL,
    world_size INTEGER, num_params INTEGER, config TEXT);
CREATE TABLE ranks (run_id TEXT NOT NULL, rank INTEGER NOT NULL, status TEXT NOT NULL,
    error TEXT, host TEXT, last_step INTEGER NOT NULL, num_steps INTEGER NOT NULL,
    dropped INTEGER NOT NULL, last_seen REAL NOT NULL, PRIMARY KEY (run_id, rank));
CREATE TABLE events (id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, rank INTEGER NOT NULL,
    type TEXT NOT NULL, step INTEGER, time REAL NOT NULL, body TEXT NOT NULL);
CREATE INDEX events_by_run ON events (run_id, type, rank, step);
PRAGMA user_version = 1;
"""
