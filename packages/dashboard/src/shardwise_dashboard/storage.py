"""Run history in one SQLite file: every accepted event, plus a summary row per run and rank.

A batch is written in one transaction (one commit per POST, whatever its size), which is what
lets 8 ranks at 10 steps/s each, and far more, keep up on one connection. The file is in WAL
mode with synchronous=NORMAL: a committed batch survives the dashboard being killed or
restarted (only a power cut can lose the last commits), and readers never block the writer for
long. All access goes through one connection guarded by a lock, since FastAPI calls us from
its thread pool.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Version of the tables below; bumped when they change shape.
_DB_VERSION = 1

_TABLES = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    started REAL NOT NULL,       -- earliest event time seen
    last_seen REAL NOT NULL,     -- latest event time seen
    world_size INTEGER,          -- from run_started; NULL until one arrives
    num_params INTEGER,
    config TEXT                  -- JSON object
);
CREATE TABLE IF NOT EXISTS ranks (
    run_id TEXT NOT NULL,
    rank INTEGER NOT NULL,
    status TEXT NOT NULL,        -- running | finished | failed
    error TEXT,
    host TEXT,
    last_step INTEGER NOT NULL,  -- -1 before the first step
    num_steps INTEGER NOT NULL,
    dropped INTEGER NOT NULL,    -- events the rank reported it could not deliver
    last_seen REAL NOT NULL,
    PRIMARY KEY (run_id, rank)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    rank INTEGER NOT NULL,
    type TEXT NOT NULL,
    step INTEGER,
    time REAL NOT NULL,
    body TEXT NOT NULL           -- the validated event as JSON
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, type, rank, step);
"""

_UPSERT_RUN = """
INSERT INTO runs (run_id, started, last_seen) VALUES (:run_id, :first, :last)
ON CONFLICT (run_id) DO UPDATE SET
    started = min(runs.started, excluded.started),
    last_seen = max(runs.last_seen, excluded.last_seen)
"""

_DESCRIBE_RUN = """
UPDATE runs SET world_size = :world_size, num_params = :num_params, config = :config
WHERE run_id = :run_id
"""

_UPSERT_RANK = """
INSERT INTO ranks (run_id, rank, status, error, host, last_step, num_steps, dropped, last_seen)
VALUES (:run_id, :rank, coalesce(:status, 'running'), :error, :host, :last_step, :num_steps,
        :dropped, :last_seen)
ON CONFLICT (run_id, rank) DO UPDATE SET
    status = coalesce(:status, ranks.status),
    error = coalesce(:error, ranks.error),
    host = coalesce(:host, ranks.host),
    last_step = max(ranks.last_step, :last_step),
    num_steps = ranks.num_steps + :num_steps,
    dropped = ranks.dropped + :dropped,
    last_seen = max(ranks.last_seen, :last_seen)
"""

_RUN_SUMMARIES = """
SELECT r.run_id, r.started, r.last_seen, r.world_size, r.num_params,
       count(k.rank), coalesce(sum(k.status = 'finished'), 0),
       coalesce(sum(k.status = 'failed'), 0), coalesce(max(k.last_step), -1),
       coalesce(sum(k.dropped), 0)
FROM runs r LEFT JOIN ranks k ON k.run_id = r.run_id
{where}
GROUP BY r.run_id ORDER BY r.started DESC, r.run_id
"""


# Every k-th step of each rank, k = ceil(steps / max_points), plus its last and its overflows.
_THINNED_STEPS = """
SELECT e.rank, e.body FROM events e
JOIN ranks k ON k.run_id = e.run_id AND k.rank = e.rank
WHERE e.run_id = ?1 AND e.type = 'step' AND (
    e.step % max(1, (k.last_step + ?2) / ?3) = 0
    OR e.step = k.last_step
    OR json_extract(e.body, '$.overflow')
)
ORDER BY e.rank, e.step, e.id
"""


class RunStore:
    """Run history over one SQLite file.

    Args:
        path: the database file, created with its tables when missing.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Autocommit mode: transactions are opened explicitly, one per batch.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > _DB_VERSION:
            self._db.close()
            raise ValueError(
                f"{self.path} holds dashboard tables of version {version}, newer than this "
                f"shardwise-dashboard reads ({_DB_VERSION}): upgrade it or pass another --db"
            )
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.executescript(_TABLES)
        self._db.execute(f"PRAGMA user_version = {_DB_VERSION}")

    def add(self, events: Sequence[dict[str, Any]]) -> None:
        """Store validated events (dicts in the schema's JSON shape) in one transaction."""
        rows: list[tuple[Any, ...]] = []
        runs: dict[str, dict[str, Any]] = {}
        described: dict[str, dict[str, Any]] = {}
        ranks: dict[tuple[str, int], dict[str, Any]] = {}
        for event in events:
            run_id, rank, kind, time = event["run_id"], event["rank"], event["type"], event["time"]
            rows.append(
                (run_id, rank, kind, event.get("step"), time, json.dumps(event, allow_nan=False))
            )
            seen = runs.setdefault(run_id, {"run_id": run_id, "first": time, "last": time})
            seen["first"], seen["last"] = min(seen["first"], time), max(seen["last"], time)
            summary = ranks.setdefault(
                (run_id, rank),
                {
                    "run_id": run_id,
                    "rank": rank,
                    "status": None,
                    "error": None,
                    "host": None,
                    "last_step": -1,
                    "num_steps": 0,
                    "dropped": 0,
                    "last_seen": time,
                },
            )
            summary["last_seen"] = max(summary["last_seen"], time)
            if kind == "run_started":
                described[run_id] = {
                    "run_id": run_id,
                    "world_size": event["world_size"],
                    "num_params": event["num_params"],
                    "config": json.dumps(event["config"], allow_nan=False),
                }
                summary["host"] = event["host"]
            elif kind == "step":
                summary["last_step"] = max(summary["last_step"], event["step"])
                summary["num_steps"] += 1
            elif kind == "run_finished":
                summary["status"], summary["error"] = event["status"], event["error"]
            elif kind == "dropped":
                summary["dropped"] += event["count"]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT INTO events (run_id, rank, type, step, time, body) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    rows,
                )
                self._db.executemany(_UPSERT_RUN, list(runs.values()))
                self._db.executemany(_DESCRIBE_RUN, list(described.values()))
                self._db.executemany(_UPSERT_RANK, list(ranks.values()))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def runs(self) -> list[dict[str, Any]]:
        """Every run, newest first, with its status and progress."""
        with self._lock:
            rows = self._db.execute(_RUN_SUMMARIES.format(where="")).fetchall()
        return [_summary(row) for row in rows]

    def run(self, run_id: str, max_points: int | None = None) -> dict[str, Any] | None:
        """One run: its summary and config, and per rank its status, its step events (in
        step order) and its latest chunk snapshot; None when the run is unknown.

        Args:
            run_id: the run.
            max_points: when set, a rank's steps are thinned to about this many (every k-th
                step, plus its last step and every overflow, so no overflow mark is lost).
        """
        with self._lock:
            row = self._db.execute(
                _RUN_SUMMARIES.format(where="WHERE r.run_id = ?"), (run_id,)
            ).fetchone()
            if row is None:
                return None
            config = self._db.execute(
                "SELECT config FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()[0]
            ranks = self._db.execute(
                "SELECT rank, status, error, host, last_step, num_steps, dropped, last_seen "
                "FROM ranks WHERE run_id = ? ORDER BY rank",
                (run_id,),
            ).fetchall()
            if max_points is None:
                steps = self._db.execute(
                    "SELECT rank, body FROM events WHERE run_id = ? AND type = 'step' "
                    "ORDER BY rank, step, id",
                    (run_id,),
                ).fetchall()
            else:
                steps = self._db.execute(
                    _THINNED_STEPS, (run_id, max_points, max_points)
                ).fetchall()
            snapshots = self._db.execute(
                "SELECT rank, body FROM events WHERE id IN (SELECT max(id) FROM events "
                "WHERE run_id = ? AND type = 'chunks' GROUP BY rank)",
                (run_id,),
            ).fetchall()
        detail: dict[str, Any] = {
            **_summary(row),
            "config": json.loads(config) if config is not None else None,
        }
        per_rank: dict[int, dict[str, Any]] = {
            rank: {
                "rank": rank,
                "status": status,
                "error": error,
                "host": host,
                "last_step": last_step,
                "num_steps": num_steps,
                "dropped": dropped,
                "last_seen": last_seen,
                "steps": [],
                "chunks": None,
            }
            for rank, status, error, host, last_step, num_steps, dropped, last_seen in ranks
        }
        for rank, body in steps:
            per_rank[rank]["steps"].append(json.loads(body))
        for rank, body in snapshots:
            per_rank[rank]["chunks"] = json.loads(body)
        detail["ranks"] = list(per_rank.values())
        return detail

    def count_events(self, run_id: str | None = None) -> int:
        """Events stored (for one run, or in all)."""
        with self._lock:
            if run_id is None:
                return int(self._db.execute("SELECT count(*) FROM events").fetchone()[0])
            return int(
                self._db.execute(
                    "SELECT count(*) FROM events WHERE run_id = ?", (run_id,)
                ).fetchone()[0]
            )

    def close(self) -> None:
        """Close the connection (the file keeps everything committed)."""
        with self._lock:
            self._db.close()


def _summary(row: tuple[Any, ...]) -> dict[str, Any]:
    run_id, started, last_seen, world_size, num_params, seen, finished, failed, step, dropped = row
    if failed:
        status = "failed"
    elif finished and finished >= (world_size if world_size is not None else seen):
        # Without a run_started (the dashboard came up mid-run) the ranks seen stand in.
        status = "finished"
    else:
        status = "running"
    return {
        "run_id": run_id,
        "status": status,
        "started": started,
        "last_seen": last_seen,
        "world_size": world_size,
        "num_params": num_params,
        "ranks_seen": seen,
        "ranks_finished": finished,
        "last_step": step,
        "dropped": dropped,
    }
