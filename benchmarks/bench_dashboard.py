"""Load test of the dashboard's ingestion on loopback: simulated ranks against a real server.

    python benchmarks/bench_dashboard.py [--ranks 64 256 1024] [--rate 1] [--seconds 20]
        [--ranks-per-node 8] [--flush-interval 0.5] [--chunks 64] [--chunk-every 10]
        [--legacy-ranks 256 --legacy-rate 2] [--saturate-seconds 0] [--no-write]

For each rank count, starts `shardwise-dashboard serve` (uvicorn, one process, a fresh SQLite
file) in a subprocess and plays a training run against it: every rank steps `--rate` times a
second, in step with the others as synchronous data parallelism does, with a `--chunks`-chunk
snapshot every `--chunk-every` steps. Delivery is what shardwise's telemetry does (see
packages/core/src/shardwise/telemetry/sinks.py): each rank's emitter holds its events up to
`--flush-interval` s, the ranks of a node hand them to one sender that posts them together (one
new connection per POST, gzipped over 16 KiB). One thread per node plays that node.
`--legacy-ranks` adds a run of the delivery before it (each rank posts each step at once, alone)
for comparison. `--saturate-seconds` adds a phase where 8 clients post batches of 50 step
events back to back on kept-alive connections: the ceiling of this machine.

Measured: events sent, accepted and stored (any accepted but not stored is a loss and fails the
run), POSTs/s, latency of a POST (send to answer, after the commit), age of an event when its
POST was answered (creation to stored: includes the time it waited to be batched), the server
process's CPU (psutil), and the database's growth per hour of run, as written and once
history older than the server's --thin-after is thinned. Writes its table into
benchmarks/RESULTS.md between the dashboard-load markers (only that block). Never imports
torch, like the dashboard.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import http.client
import json
import os
import platform
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- dashboard-load:begin -->", "<!-- dashboard-load:end -->"
COMPRESS_MIN_BYTES = 16 * 1024  # as HttpSink


@dataclass
class Tally:
    """What one run sent and how long each POST and each event took."""

    sent: int = 0
    accepted: int = 0
    failed_posts: int = 0
    latencies_s: list[float] = field(default_factory=list)
    ages_s: list[float] = field(default_factory=list)
    late_posts: int = 0  # posts that left more than a flush interval after they were due
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, times: list[float], ok: bool, latency_s: float) -> None:
        answered = time.time()
        with self.lock:
            self.sent += len(times)
            self.latencies_s.append(latency_s)
            if ok:
                self.accepted += len(times)
                self.ages_s.extend(answered - t for t in times)
            else:
                self.failed_posts += 1


def step_event(run_id: str, rank: int, step: int, rate: float) -> dict[str, Any]:
    """A step event of the size and shape shardwise's recorder sends."""
    return {
        "schema": 1,
        "type": "step",
        "run_id": run_id,
        "rank": rank,
        "time": time.time(),
        "step": step,
        "loss": 2.0 + 1.0 / (step + 1),
        "loss_scale": 65536.0,
        "overflow": False,
        "grad_norm": 0.5,
        "step_time_s": 1.0 / rate * (1.0 + 0.01 * (rank % 7)),
        "comm_bytes": {"all_gather": 2_000_000, "reduce_scatter": 1_000_000, "all_reduce": 8},
        "moved_bytes": {"to_device": 0, "to_host": 0},
        "memory": {"device": 40_000_000 + rank, "host": 0},
        "skipped_in_a_row": 0,
        "warning": None,
    }


def chunks_event(run_id: str, rank: int, step: int, num_chunks: int) -> dict[str, Any]:
    return {
        "schema": 1,
        "type": "chunks",
        "run_id": run_id,
        "rank": rank,
        "time": time.time(),
        "step": step,
        "chunks": [
            {
                "id": i,
                "numel": 65536,
                "state": "sharded",
                "sharded": True,
                "payload": "device" if (i + rank) % 9 else "host",
                "optim": "device",
                "tensor_states": {"free": 4},
            }
            for i in range(num_chunks)
        ],
    }


class Encoded:
    """Events as JSON text with their creation times. The chunk list of a rank's snapshot is
    encoded once and reused: the client shares the server's two cores, and building 65,536
    chunk rows per snapshot step in Python would be the client's time, not the server's."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.times: list[float] = []
        self._chunks: dict[tuple[int, int], str] = {}

    def add(self, event: dict[str, Any]) -> None:
        self.texts.append(json.dumps(event))
        self.times.append(event["time"])

    def add_chunks(self, run_id: str, rank: int, step: int, num_chunks: int) -> None:
        key = (rank, num_chunks)
        if key not in self._chunks:
            self._chunks[key] = json.dumps(chunks_event(run_id, rank, 0, num_chunks)["chunks"])
        now = time.time()
        head = {"schema": 1, "type": "chunks", "run_id": run_id, "rank": rank, "time": now}
        self.texts.append(
            json.dumps(head)[:-1] + f', "step": {step}, "chunks": {self._chunks[key]}}}'
        )
        self.times.append(now)

    def take(self) -> tuple[list[str], list[float]]:
        texts, times = self.texts, self.times
        self.texts, self.times = [], []
        return texts, times

    def __len__(self) -> int:
        return len(self.texts)


def post(url: str, texts: list[str]) -> bool:
    """One POST on a new connection, gzipped when large, as HttpSink sends it."""
    body = ('{"events": [' + ", ".join(texts) + "]}").encode()
    headers = {"Content-Type": "application/json"}
    if len(body) >= COMPRESS_MIN_BYTES:
        body = gzip.compress(body, compresslevel=1)
        headers["Content-Encoding"] = "gzip"
    request = urllib.request.Request(url + "/api/v1/events", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return response.status == 200
    except OSError:
        return False


@dataclass(frozen=True, kw_only=True)
class Plan:
    run_id: str
    rate: float
    flush_interval_s: float
    num_chunks: int
    chunk_every: int
    start: float
    until: float


def node(url: str, plan: Plan, ranks: range, tally: Tally, phase: float = 1.0) -> None:
    """The ranks of one node: they step together; their sender posts what each rank's emitter
    held for `phase` (in [0.5, 1), per node, as TelemetryEmitter) of a flush interval."""
    pending = Encoded()
    first_at = 0.0
    step = 0
    while True:
        due = plan.start + step / plan.rate
        flush_at = first_at + plan.flush_interval_s * phase
        if len(pending) and (flush_at <= due or due >= plan.until):
            time.sleep(max(0.0, flush_at - time.perf_counter()))
            if time.perf_counter() - flush_at > plan.flush_interval_s:
                with tally.lock:
                    tally.late_posts += 1
            texts, times = pending.take()
            sent_at = time.perf_counter()
            ok = post(url, texts)
            tally.record(times, ok, time.perf_counter() - sent_at)
            continue
        if due >= plan.until:
            return
        time.sleep(max(0.0, due - time.perf_counter()))
        if not len(pending):
            first_at = time.perf_counter()
        for rank in ranks:
            pending.add(step_event(plan.run_id, rank, step, plan.rate))
            if step % plan.chunk_every == 0:
                pending.add_chunks(plan.run_id, rank, step, plan.num_chunks)
        step += 1


def node_phases(count: int) -> list[float]:
    # Evenly spread, in a scrambled order (as hashes of hostnames would be).
    return [0.5 + ((i * 0.6180339887) % 1.0) / 2 for i in range(count)]


def legacy_rank(url: str, plan: Plan, rank: int, tally: Tally) -> None:
    """Delivery before batching: each step posted at once, alone, by its rank."""
    step = 0
    while (due := plan.start + step / plan.rate) < plan.until:
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        elif now - due > 1.0 / plan.rate:
            with tally.lock:
                tally.late_posts += 1
        events = Encoded()
        events.add(step_event(plan.run_id, rank, step, plan.rate))
        if step % plan.chunk_every == 0:
            events.add_chunks(plan.run_id, rank, step, plan.num_chunks)
        texts, times = events.take()
        sent_at = time.perf_counter()
        ok = post(url, texts)
        tally.record(times, ok, time.perf_counter() - sent_at)
        step += 1


def saturating_client(host: str, port: int, client: int, until: float, tally: Tally) -> None:
    connection = http.client.HTTPConnection(host, port, timeout=10)
    step = 0
    try:
        while time.perf_counter() < until:
            events = [step_event("saturation", client, step + i, 10.0) for i in range(50)]
            body = json.dumps({"events": events}).encode()
            sent_at = time.perf_counter()
            try:
                connection.request(
                    "POST", "/api/v1/events", body, {"Content-Type": "application/json"}
                )
                response = connection.getresponse()
                response.read()
                ok = response.status == 200
            except OSError:
                ok = False
                connection.close()
                connection = http.client.HTTPConnection(host, port, timeout=10)
            tally.record([e["time"] for e in events], ok, time.perf_counter() - sent_at)
            step += 50
    finally:
        connection.close()


def stored_events(db: Path, run_id: str) -> int:
    with sqlite3.connect(db) as connection:
        return int(
            connection.execute(
                "SELECT count(*) FROM events WHERE run_id = ?", (run_id,)
            ).fetchone()[0]
        )


def database_bytes(db: Path) -> int:
    """Bytes of the database's pages in use (the server checkpointed its log at exit)."""
    with sqlite3.connect(db) as connection:
        pages, free, size = (
            connection.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("page_count", "freelist_count", "page_size")
        )
    return int((pages - free) * size)


def thinned_bytes(db: Path) -> int:
    """Bytes in use once every step of the history is thinned as the server's retention
    does past --thin-after (every 10th step, snapshots every 100th and each rank's latest)."""
    from shardwise_dashboard.retention import Retention
    from shardwise_dashboard.storage import RunStore

    store = RunStore(db)
    try:
        retention = Retention(
            store, max_age_s=None, max_bytes=None, thin_after_s=-1e12, thin_every=10
        )
        return retention.run_once().used_bytes
    finally:
        store.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server(db: Path, port: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "shardwise_dashboard", "serve", "--port", str(port)]
    server = subprocess.Popen([*command, "--db", str(db)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/health", timeout=1):
                return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"the dashboard exited with code {server.returncode}") from None
            time.sleep(0.1)
    server.kill()
    raise SystemExit("the dashboard did not answer within 30 s")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def run_scenario(
    name: str, ranks: int, per_node: int, args: argparse.Namespace, seconds: float
) -> dict[str, Any]:
    """One fresh server, one simulated run against it; the row of the table."""
    with tempfile.TemporaryDirectory() as scratch:
        db = Path(scratch) / "bench.sqlite"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(db, port)
        try:
            process = psutil.Process(server.pid)
            tally = Tally()
            rate = args.legacy_rate if name == "legacy" else args.rate
            start = time.perf_counter() + 0.5
            plan = Plan(
                run_id=name,
                rate=rate,
                flush_interval_s=args.flush_interval,
                num_chunks=args.chunks,
                chunk_every=args.chunk_every,
                start=start,
                until=start + seconds,
            )
            if name == "legacy":
                workers = [
                    threading.Thread(target=legacy_rank, args=(url, plan, r, tally))
                    for r in range(ranks)
                ]
            elif name == "saturation":
                until = start + seconds
                workers = [
                    threading.Thread(
                        target=saturating_client, args=("127.0.0.1", port, c, until, tally)
                    )
                    for c in range(8)
                ]
            else:
                workers = [
                    threading.Thread(
                        target=node,
                        # Nodes' flush phases: spread over [0.5, 1) as hostnames' hashes are.
                        args=(url, plan, range(n, min(n + per_node, ranks)), tally, phase),
                    )
                    for n, phase in zip(
                        range(0, ranks, per_node), node_phases(-(-ranks // per_node)), strict=True
                    )
                ]
            cpu_before = sum(process.cpu_times()[:2])
            client_before = time.process_time()
            began = time.perf_counter()
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            elapsed = time.perf_counter() - began
            server_cpu = (sum(process.cpu_times()[:2]) - cpu_before) / elapsed
            client_cpu = (time.process_time() - client_before) / elapsed
        finally:
            server.terminate()
            server.wait(timeout=30)
        stored = stored_events(db, name)
        written = database_bytes(db)
        thinned = thinned_bytes(db) if name != "saturation" else 0
    hour = 3600.0 / seconds
    return {
        "phase": name,
        "ranks": ranks if name != "saturation" else 8,
        "senders": len(workers),
        "rate": plan.rate,
        "seconds": round(elapsed, 2),
        "events_sent": tally.sent,
        "events_accepted": tally.accepted,
        "events_stored": stored,
        "lost": tally.accepted - stored,
        "failed_posts": tally.failed_posts,
        "late_posts": tally.late_posts,
        "posts": len(tally.latencies_s),
        "posts_per_s": round(len(tally.latencies_s) / elapsed, 1),
        "events_per_s": round(tally.accepted / elapsed, 1),
        "p50_ms": round(1000 * percentile(tally.latencies_s, 0.50), 1),
        "p99_ms": round(1000 * percentile(tally.latencies_s, 0.99), 1),
        "age_p50_ms": round(1000 * percentile(tally.ages_s, 0.50), 1),
        "age_p99_ms": round(1000 * percentile(tally.ages_s, 0.99), 1),
        "server_cpu_cores": round(server_cpu, 2),
        "client_cpu_cores": round(client_cpu, 2),
        "db_mb_per_hour": round(written * hour / 2**20, 0),
        "db_mb_per_hour_thinned": round(thinned * hour / 2**20, 0),
    }


def write_results(
    path: Path, command: str, args: argparse.Namespace, rows: list[dict[str, Any]], load: str
) -> None:
    lines = [
        BEGIN,
        "## Dashboard ingestion under load",
        "",
        f"Written by `{command}` on {datetime.date.today().isoformat()}: {machine()}; server "
        "(uvicorn, one process, a fresh SQLite file per row) and the simulated ranks (one "
        "thread per sender, in one client process) on the same machine, over loopback, while "
        f"other jobs shared it (load average before the run: {load}, on {os.cpu_count()} "
        "cores).",
        f"Each rank steps {args.rate:g} times a second in step with the others, with a "
        f"{args.chunks}-chunk snapshot every {args.chunk_every} steps. *node*: as shardwise's "
        "telemetry delivers, each rank's emitter holds events for its node's share (0.5 to 1) "
        f"of {args.flush_interval:g} s and the {args.ranks_per_node} ranks of a node share one "
        "sender (one POST per flush, a new connection each, gzipped over 16 KiB). *legacy*: "
        "each rank posts each step at once, alone (the delivery before). *saturation*: 8 "
        "clients post batches of 50 step events back to back on kept-alive connections. POST "
        "latency: send to answer (after the commit). Age: event created to its POST answered "
        "(includes the wait to be batched). Server CPU: cores the server process used while "
        "the ranks ran (psutil). Database: MB per hour of run in use as written, and once "
        "history is thinned (`--thin-after-minutes`, default 60: every 10th step kept). Lost: "
        "accepted but not in SQLite.",
        "",
        "| delivery | ranks | senders | target | events sent | stored | lost | failed POSTs | "
        "POSTs/s | events/s stored | POST p50 / p99 ms | age p50 / p99 ms | server CPU | "
        "DB MB/h written / thinned |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: |",
    ]
    for row in rows:
        target = (
            "as fast as answered"
            if row["phase"] == "saturation"
            else f"{row['rate']:g} per s per rank, {row['seconds']:.0f} s"
        )
        database = (
            f"{row['db_mb_per_hour']:,.0f} / {row['db_mb_per_hour_thinned']:,.0f}"
            if row["phase"] != "saturation"
            else "-"
        )
        lines.append(
            f"| {row['phase']} | {row['ranks']:,} | {row['senders']:,} | {target} | "
            f"{row['events_sent']:,} | {row['events_stored']:,} | {row['lost']} | "
            f"{row['failed_posts']} | {row['posts_per_s']:,.1f} | {row['events_per_s']:,.1f} | "
            f"{row['p50_ms']:.0f} / {row['p99_ms']:.0f} | "
            f"{row['age_p50_ms']:.0f} / {row['age_p99_ms']:.0f} | "
            f"{row['server_cpu_cores']:.2f} | {database} |"
        )
    lines.append(END)
    block = "\n".join(lines)
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--rate", type=float, default=1.0, help="steps/s per rank")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each run")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--flush-interval", type=float, default=0.5, help="seconds (emitter)")
    parser.add_argument("--chunks", type=int, default=64, help="chunks per snapshot")
    parser.add_argument("--chunk-every", type=int, default=10, help="steps between snapshots")
    parser.add_argument("--legacy-ranks", type=int, default=0, help="0 skips the legacy run")
    parser.add_argument("--legacy-rate", type=float, default=2.0)
    parser.add_argument("--saturate-seconds", type=float, default=0.0, help="0 skips it")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    numbers = [*args.ranks, args.rate, args.seconds, args.ranks_per_node, args.chunk_every]
    if min(numbers) <= 0 or args.flush_interval < 0:
        parser.error(f"counts, rates and lengths must be positive, got {numbers}")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    command = " ".join(["python benchmarks/bench_dashboard.py", *sys.argv[1:]])
    rows = []
    if args.legacy_ranks:
        rows.append(run_scenario("legacy", args.legacy_ranks, 1, args, args.seconds))
    for ranks in args.ranks:
        rows.append(run_scenario("node", ranks, args.ranks_per_node, args, args.seconds))
    if args.saturate_seconds > 0:
        rows.append(run_scenario("saturation", 8, 1, args, args.saturate_seconds))
    print(json.dumps({"machine": machine(), "load_before": load, "phases": rows}, indent=2))
    if not args.no_write:
        write_results(args.results, command, args, rows, load)
    # At the stated rates nothing may be lost or refused.
    if any(row["lost"] or (row["phase"] == "node" and row["failed_posts"]) for row in rows):
        raise SystemExit("events were lost or refused: see the table above")


if __name__ == "__main__":
    main()
