"""Runs can be told apart: a run_started event's run_name, entry_point and script are kept with
the run and returned in its summary (the runs list) and detail; runs from a shardwise that
never sent them read as unknown; a history file of version 2 (before them) is migrated."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_support import started_event, step_event
from fastapi.testclient import TestClient

from shardwise_dashboard.app import create_app
from shardwise_dashboard.db_schema import DB_VERSION, MIGRATIONS
from shardwise_dashboard.settings import Settings

NAMED = {
    "run_name": "llama-lr3e-4",
    "entry_point": "Lightning GeminiStrategy",
    "script": "/home/me/project/train.py",
}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(db_path=tmp_path / "runs.sqlite"))) as test_client:
        yield test_client


def post(client: TestClient, events: list[dict[str, Any]]) -> Any:
    return client.post("/api/v1/events", json={"events": events})


def identity(summary: dict[str, Any]) -> dict[str, Any]:
    return {key: summary[key] for key in NAMED}


def test_a_run_says_its_name_entry_point_and_script(client: TestClient) -> None:
    events = [started_event("named", rank, **NAMED) for rank in range(2)]
    events += [started_event("plain", rank) for rank in range(2)]  # an older shardwise's
    events += [step_event(run, 0, 0) for run in ("named", "plain")]
    assert post(client, events).status_code == 200
    listed = {run["run_id"]: identity(run) for run in client.get("/api/v1/runs").json()}
    assert listed == {"named": NAMED, "plain": dict.fromkeys(NAMED)}
    assert identity(client.get("/api/v1/runs/named").json()) == NAMED
    assert identity(client.get("/api/v1/overview/named").json()) == NAMED


@pytest.mark.parametrize(
    ("field", "value"),
    [("run_name", ""), ("run_name", "x" * 129), ("entry_point", 3), ("script", "s" * 256)],
)
def test_bad_identity_fields_are_refused(client: TestClient, field: str, value: Any) -> None:
    response = post(client, [started_event(**{field: value})])
    assert response.status_code == 422 and field in response.text, response.text


def test_a_version_2_history_file_is_migrated(tmp_path: Path) -> None:
    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as old:
        old.executescript(_VERSION_1_TABLES + MIGRATIONS[1] + "PRAGMA user_version = 2;")
        old.execute("INSERT INTO runs VALUES ('v2', 1.0, 3.0, 2, 10, '{}', 3.0)")
    with TestClient(create_app(Settings(db_path=db))) as client:
        (before,) = client.get("/api/v1/runs").json()
        assert before["run_id"] == "v2" and identity(before) == dict.fromkeys(NAMED)
        assert post(client, [started_event("v3", 0, **NAMED)]).status_code == 200
        listed = {run["run_id"]: identity(run) for run in client.get("/api/v1/runs").json()}
        assert listed["v3"] == NAMED
    with sqlite3.connect(db) as migrated:
        assert migrated.execute("PRAGMA user_version").fetchone()[0] == DB_VERSION == 3


# The tables as version 1 of the dashboard wrote them (MIGRATIONS[1] made them version 2).
_VERSION_1_TABLES = """
CREATE TABLE runs (run_id TEXT PRIMARY KEY, started REAL NOT NULL, last_seen REAL NOT NULL,
    world_size INTEGER, num_params INTEGER, config TEXT);
CREATE TABLE ranks (run_id TEXT NOT NULL, rank INTEGER NOT NULL, status TEXT NOT NULL,
    error TEXT, host TEXT, last_step INTEGER NOT NULL, num_steps INTEGER NOT NULL,
    dropped INTEGER NOT NULL, last_seen REAL NOT NULL, PRIMARY KEY (run_id, rank));
CREATE TABLE events (id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, rank INTEGER NOT NULL,
    type TEXT NOT NULL, step INTEGER, time REAL NOT NULL, body TEXT NOT NULL);
CREATE INDEX events_by_run ON events (run_id, type, rank, step);
"""
