"""Run history in one SQLite file: every accepted event, plus a summary row per run and rank.

Batches are written by `add_batches`, many POSTs in one transaction (see writer.py), which is
what lets a thousand ranks keep up on one connection. The file is in WAL mode with
synchronous=NORMAL: a committed batch survives the dashboard being killed or restarted (only a
power cut can lose the last commits), and readers never block the writer for long. All access
goes through one connection guarded by a lock, since FastAPI calls us from its thread pool.

Besides the JSON body of every event, step events keep the numbers the overview aggregates
across ranks in columns of their own, and each rank's row keeps what the overview shows of it
(placement of its chunks, first overflow, current warning), so that a page of a 1,024-rank run
reads a few thousand rows, not a million JSON bodies.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardwise_dashboard import db_queries as queries
from shardwise_dashboard.db_schema import DB_VERSION, MIGRATIONS, TABLES

_PLACEMENT = {
    ("device", "gathered"): "D",
    ("device", "sharded"): "d",
    ("host", "gathered"): "H",
    ("host", "sharded"): "h",
}


# The most evals of a rank `RunStore.run` returns unthinned (steps have no such bound).
MAX_EVALS = 100_000

# Bodies at least this long are kept zlib-compressed: a chunk snapshot shrinks about 14-fold,
# which is most of the database of a run with many ranks, for ~20 us each.
_COMPRESS_MIN_CHARS = 512


def encode_body(text: str) -> str | bytes:
    """How an event's JSON is kept in `events.body`."""
    return zlib.compress(text.encode(), 1) if len(text) >= _COMPRESS_MIN_CHARS else text


def decode_body(body: str | bytes) -> Any:
    """An event from `events.body` (text, or compressed bytes)."""
    return json.loads(zlib.decompress(body) if isinstance(body, bytes) else body)


class StoreError(ValueError):
    """The database file cannot be used; the message is one line naming the file and why."""


class StoreBusy(RuntimeError):
    """Another process holds the database's write lock: try again shortly."""


def _placement(chunks: list[dict[str, Any]]) -> str:
    return "".join(_PLACEMENT[chunk["payload"], chunk["state"]] for chunk in chunks)


# S: the disk tier (storage files).
_OPTIM = {"device": "D", "host": "H", "disk": "S", None: "-"}


def _optim_letters(chunks: list[dict[str, Any]]) -> str:
    return "".join(_OPTIM[chunk["optim"]] for chunk in chunks)


def _is_busy(error: sqlite3.Error) -> bool:
    return isinstance(error, sqlite3.OperationalError) and (
        "locked" in str(error) or "busy" in str(error)
    )


class RunStore:
    """Run history over one SQLite file.

    Args:
        path: the database file, created with its tables when missing.
        busy_timeout_s: how long a write waits for a lock another process holds before it
            gives up with `StoreBusy`.
        stale_after_s: a running run (or rank) from which nothing has arrived for this long
            is reported "stale": its ranks died without saying so.
        clock: the server's clock (tests turn it).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        busy_timeout_s: float = 1.0,
        stale_after_s: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._lock = threading.Lock()
        try:
            self._db = self._open(busy_timeout_s)
        except sqlite3.Error as error:
            reason = "it is locked by another process" if _is_busy(error) else str(error)
            raise StoreError(
                f"cannot use {self.path} as the dashboard's database: {reason} "
                "(pass --db with a writable SQLite file, or a new path)"
            ) from None
        except OSError as error:
            raise StoreError(
                f"cannot use {self.path} as the dashboard's database: {error.strerror or error} "
                "(pass --db with a writable SQLite file, or a new path)"
            ) from None

    def _open(self, busy_timeout_s: float) -> sqlite3.Connection:
        if self.path.is_dir():
            raise StoreError(
                f"cannot use {self.path} as the dashboard's database: it is a directory "
                "(pass --db with a file path inside it, e.g. "
                f"{self.path / 'dashboard.sqlite'})"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode: transactions are opened explicitly, one per group of batches.
        db = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=busy_timeout_s
        )
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > DB_VERSION:
                raise StoreError(
                    f"{self.path} holds dashboard tables of version {version}, newer than this "
                    f"shardwise-dashboard reads ({DB_VERSION}): upgrade it or pass another --db"
                )
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            if version < DB_VERSION:
                # One transaction: a file is either migrated whole or left as it was.
                has_tables = db.execute(
                    "SELECT count(*) FROM sqlite_master WHERE name = 'events'"
                ).fetchone()[0]
                if has_tables and version not in MIGRATIONS:
                    raise StoreError(
                        f"cannot use {self.path} as the dashboard's database: it holds an "
                        "'events' table this dashboard did not write (pass another --db)"
                    )
                script = "BEGIN IMMEDIATE;\n"
                for old in range(version if has_tables else DB_VERSION, DB_VERSION):
                    script += MIGRATIONS[old]
                script += TABLES + f"PRAGMA user_version = {DB_VERSION};\nCOMMIT;\n"
                db.executescript(script)
            else:
                # Readable is not enough: a read-only file must fail now, not at the first
                # POST. Rewriting the version is a real write (SQLite opens a file it may not
                # write read-only, without a word), rolled back.
                db.execute("BEGIN IMMEDIATE")
                try:
                    db.execute(f"PRAGMA user_version = {DB_VERSION}")
                finally:
                    db.execute("ROLLBACK")
                # The indexes of this version changed once without a new version number: a
                # file written before lacks the ones the reads name (INDEXED BY). Every
                # statement is IF NOT EXISTS, so a current file is left as it is.
                db.executescript("BEGIN IMMEDIATE;\n" + TABLES + "COMMIT;\n")
        except BaseException:
            db.close()
            raise
        return db

    def add(self, events: Sequence[dict[str, Any]]) -> None:
        """Store validated events (dicts in the schema's JSON shape) in one transaction."""
        self.add_batches([events])

    def add_batches(
        self,
        batches: Sequence[Sequence[dict[str, Any]]],
        bodies: Sequence[Sequence[str]] | None = None,
    ) -> None:
        """Store several batches of validated events in one transaction (all or none).

        Args:
            batches: the events.
            bodies: each event's JSON, when the caller has it already (else made here).

        Raises:
            StoreBusy: another process held the write lock for longer than the busy timeout.
        """
        received = self.clock()
        rows: list[tuple[Any, ...]] = []
        runs: dict[str, dict[str, Any]] = {}
        described: dict[str, dict[str, Any]] = {}
        ranks: dict[tuple[str, int], dict[str, Any]] = {}
        for index, events in enumerate(batches):
            texts = bodies[index] if bodies is not None else event_bodies(events)
            for event, text in zip(events, texts, strict=True):
                rows.append(_row(event, text))
                _summarise(event, received, runs, described, ranks)
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as error:
                if _is_busy(error):
                    raise StoreBusy(f"{self.path} is locked by another process") from None
                raise
            try:
                self._db.executemany(
                    "INSERT INTO events (run_id, rank, type, step, time, body, step_time_s, "
                    "sent_bytes, moved_bytes, mem_device, mem_host, overflow) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
                self._db.executemany(queries.UPSERT_RUN, list(runs.values()))
                self._db.executemany(queries.DESCRIBE_RUN, list(described.values()))
                self._db.executemany(queries.UPSERT_RANK, list(ranks.values()))
                self._db.execute("COMMIT")
            except BaseException as error:
                self._db.execute("ROLLBACK")
                if isinstance(error, sqlite3.OperationalError) and _is_busy(error):
                    raise StoreBusy(f"{self.path} is locked by another process") from None
                raise

    def runs(self) -> list[dict[str, Any]]:
        """Every run, newest first, with its status and progress."""
        with self._lock:
            rows = self._db.execute(queries.RUN_SUMMARIES.format(where="")).fetchall()
        now = self.clock()
        return [self._summary(row, now) for row in rows]

    def run(
        self, run_id: str, max_points: int | None = None, rank: int | None = None
    ) -> dict[str, Any] | None:
        """One run: its summary and config, and per rank its status, its step and eval events
        (in step order) and its latest chunk snapshot; None when the run is unknown.

        Args:
            run_id: the run.
            max_points: when set, a rank's steps are thinned to about this many (every k-th
                step, plus its last step and every overflow, so no overflow mark is lost), and
                its evals likewise (every k-th and the latest); unset, every step and up to
                `MAX_EVALS` evals.
            rank: when set, only this rank (of a run with many, the page's detail view).
        """
        only = "" if rank is None else f"AND rank = {int(rank)}"
        with self._lock:
            row = self._db.execute(
                queries.RUN_SUMMARIES.format(where="WHERE r.run_id = ?"), (run_id,)
            ).fetchone()
            if row is None:
                return None
            config = self._db.execute(
                "SELECT config FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()[0]
            ranks = self._db.execute(queries.RANKS.format(where=only), (run_id,)).fetchall()
            if max_points is None:
                steps = self._db.execute(
                    f"SELECT rank, body FROM events WHERE run_id = ? AND type = 'step' {only} "
                    "ORDER BY rank, step, id",
                    (run_id,),
                ).fetchall()
            else:
                steps = self._db.execute(
                    queries.THINNED_STEPS.format(rank=only.replace("rank", "e.rank")),
                    (run_id, max_points, max_points),
                ).fetchall()
            evals = self._db.execute(
                queries.EVALS.format(rank=only), (run_id, max_points or MAX_EVALS)
            ).fetchall()
            snapshots = self._db.execute(
                "SELECT rank, body FROM events WHERE id IN (SELECT max(id) FROM events "
                f"WHERE run_id = ? AND type = 'chunks' {only} GROUP BY rank)",
                (run_id,),
            ).fetchall()
        now = self.clock()
        detail: dict[str, Any] = {
            **self._summary(row, now),
            "config": json.loads(config) if config is not None else None,
        }
        per_rank = {
            r[0]: {**self._rank(r, now), "steps": [], "evals": [], "chunks": None} for r in ranks
        }
        for rank_id, body in steps:
            per_rank[rank_id]["steps"].append(decode_body(body))
        for rank_id, body in evals:
            per_rank[rank_id]["evals"].append(decode_body(body))
        for rank_id, body in snapshots:
            per_rank[rank_id]["chunks"] = decode_body(body)
        detail["ranks"] = list(per_rank.values())
        return detail

    def placement_timeline(
        self, run_id: str, rank: int, max_snapshots: int
    ) -> dict[str, Any] | None:
        """Where one rank's chunks sat, snapshot by snapshot: `steps` (ascending) and, aligned
        with them, `placement` (one letter per chunk, as `ranks.placement`) and `optim` (one
        letter per chunk: D device, H host, - none); None when the run is unknown.

        Args:
            run_id: the run.
            rank: the rank.
            max_snapshots: when the rank sent more chunk snapshots, every k-th is kept (and
                the latest), so the timeline stays this wide at most.
        """
        with self._lock:
            known = self._db.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if known is None:
                return None
            index = self._db.execute(
                "SELECT id, step FROM events WHERE run_id = ? AND type = 'chunks' AND rank = ? "
                "ORDER BY step, id",
                (run_id, rank),
            ).fetchall()
            # One snapshot per step (a resent one replaces the earlier), then thinned.
            by_step = {step: event_id for event_id, step in index}
            steps = sorted(by_step)
            every = -(-len(steps) // max_snapshots) if steps else 1
            kept = [s for i, s in enumerate(steps) if i % every == 0 or i == len(steps) - 1]
            rows = []
            for start in range(0, len(kept), 500):  # SQLite's bound-parameter limit
                ids = [by_step[s] for s in kept[start : start + 500]]
                marks = ",".join("?" * len(ids))
                rows += self._db.execute(
                    f"SELECT step, body FROM events WHERE id IN ({marks})", ids
                ).fetchall()
        snapshots = sorted(
            ((step, decode_body(body)["chunks"]) for step, body in rows), key=lambda r: r[0]
        )
        return {
            "run_id": run_id,
            "rank": rank,
            "steps": [step for step, _ in snapshots],
            "placement": [_placement(chunks) for _, chunks in snapshots],
            "optim": [_optim_letters(chunks) for _, chunks in snapshots],
        }

    def overview_rows(
        self, run_id: str, num_steps: int
    ) -> tuple[dict[str, Any], list[dict[str, Any]], list[tuple[Any, ...]]] | None:
        """What the overview aggregates: the run's summary, every rank's row, and the step
        rows (step, rank, step_time_s, sent_bytes, moved_bytes, mem_device, mem_host,
        overflow) of the latest `num_steps` steps; None when the run is unknown."""
        with self._lock:
            row = self._db.execute(
                queries.RUN_SUMMARIES.format(where="WHERE r.run_id = ?"), (run_id,)
            ).fetchone()
            if row is None:
                return None
            config = self._db.execute(
                "SELECT config FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()[0]
            ranks = self._db.execute(queries.RANKS.format(where=""), (run_id,)).fetchall()
            last_step = row[8]
            steps = self._db.execute(
                # The planner prefers the narrower index, then reads every row for its body.
                "SELECT step, rank, step_time_s, sent_bytes, moved_bytes, mem_device, mem_host, "
                "overflow FROM events INDEXED BY step_metrics "
                "WHERE run_id = ? AND type = 'step' AND step > ?",
                (run_id, last_step - num_steps),
            ).fetchall()
        now = self.clock()
        summary = {
            **self._summary(row, now),
            "config": json.loads(config) if config is not None else None,
        }
        return summary, [self._rank(r, now) for r in ranks], steps

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

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """One statement under the store's lock, in autocommit mode (retention uses it)."""
        with self._lock:
            return self._db.execute(sql, parameters).fetchall()

    def close(self) -> None:
        """Close the connection (the file keeps everything committed)."""
        with self._lock:
            self._db.close()

    def _stale(self, status: str, received: float, now: float) -> str:
        return "stale" if status == "running" and now - received > self.stale_after_s else status

    def _summary(self, row: tuple[Any, ...], now: float) -> dict[str, Any]:
        (run_id, started, last_seen, world_size, num_params, seen, finished, failed, step,
         dropped, received, warnings, run_name, entry_point, script) = row  # fmt: skip
        if failed:
            status = "failed"
        elif finished and finished >= (world_size if world_size is not None else seen):
            # Without a run_started (the dashboard came up mid-run) the ranks seen stand in.
            status = "finished"
        else:
            status = self._stale("running", received, now)
        return {
            "run_id": run_id,
            "status": status,
            "started": started,
            "last_seen": last_seen,
            "received": received,
            "world_size": world_size,
            "num_params": num_params,
            "ranks_seen": seen,
            "ranks_finished": finished,
            "ranks_warned": warnings,
            "last_step": step,
            "dropped": dropped,
            "run_name": run_name,
            "entry_point": entry_point,
            "script": script,
        }

    def _rank(self, row: tuple[Any, ...], now: float) -> dict[str, Any]:
        (rank, status, error, host, last_step, num_steps, dropped, last_seen, received, skipped,
         warning, warning_step, first_overflow, first_overflow_time, placement,
         placement_step) = row  # fmt: skip
        return {
            "rank": rank,
            "status": self._stale(status, received, now),
            "error": error,
            "host": host,
            "last_step": last_step,
            "num_steps": num_steps,
            "dropped": dropped,
            "last_seen": last_seen,
            "received": received,
            "skipped_in_a_row": skipped,
            "warning": warning,
            "warning_step": warning_step,
            "first_overflow": first_overflow,
            "first_overflow_time": first_overflow_time,
            "placement": placement,
            "placement_step": placement_step,
        }


def event_bodies(events: Sequence[dict[str, Any]]) -> list[str]:
    """Each event's JSON, as stored and as streamed."""
    return [json.dumps(event, allow_nan=False) for event in events]


def _row(event: dict[str, Any], text: str) -> tuple[Any, ...]:
    body = encode_body(text)
    head = (event["run_id"], event["rank"], event["type"], event.get("step"), event["time"], body)
    if event["type"] != "step":
        return (*head, None, None, None, None, None, None)
    moved, memory = event["moved_bytes"], event["memory"]
    return (
        *head,
        event["step_time_s"],
        sum(event["comm_bytes"].values()),
        moved["to_device"] + moved["to_host"],
        memory["device"],
        memory["host"],
        int(event["overflow"]),
    )


def _summarise(
    event: dict[str, Any],
    received: float,
    runs: dict[str, dict[str, Any]],
    described: dict[str, dict[str, Any]],
    ranks: dict[tuple[str, int], dict[str, Any]],
) -> None:
    """Fold one event into the run and rank rows that one transaction upserts."""
    run_id, rank, kind, time_s = event["run_id"], event["rank"], event["type"], event["time"]
    seen = runs.setdefault(
        run_id, {"run_id": run_id, "first": time_s, "last": time_s, "received": received}
    )
    seen["first"], seen["last"] = min(seen["first"], time_s), max(seen["last"], time_s)
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
            "last_seen": time_s,
            "received": received,
            "skipped_in_a_row": 0,
            "warning": None,
            "warning_step": None,
            "first_overflow": None,
            "first_overflow_time": None,
            "placement": None,
            "placement_step": None,
        },
    )
    summary["last_seen"] = max(summary["last_seen"], time_s)
    if kind == "run_started":
        described[run_id] = {
            "run_id": run_id,
            "world_size": event["world_size"],
            "num_params": event["num_params"],
            "config": json.dumps(event["config"], allow_nan=False),
            **{key: event.get(key) for key in ("run_name", "entry_point", "script")},
        }
        summary["host"] = event["host"]
    elif kind == "step":
        step = event["step"]
        if step >= summary["last_step"]:
            summary["last_step"] = step
            summary["skipped_in_a_row"] = event.get("skipped_in_a_row", 0)
        summary["num_steps"] += 1
        if event.get("warning") is not None and step > (summary["warning_step"] or -1):
            summary["warning"], summary["warning_step"] = event["warning"], step
        first = summary["first_overflow"]
        if event["overflow"] and (first is None or step < first):
            summary["first_overflow"], summary["first_overflow_time"] = step, time_s
    elif kind == "chunks":
        if event["step"] >= (summary["placement_step"] or -1):
            summary["placement"] = _placement(event["chunks"])
            summary["placement_step"] = event["step"]
    elif kind == "run_finished":
        summary["status"], summary["error"] = event["status"], event["error"]
    elif kind == "dropped":
        summary["dropped"] += event["count"]
