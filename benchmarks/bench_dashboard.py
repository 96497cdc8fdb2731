"""Load test of the dashboard's ingestion on loopback: simulated ranks against a real server.

    python benchmarks/bench_dashboard.py [--ranks 8] [--rate 10] [--seconds 15]
        [--saturate-seconds 5] [--batch 50] [--no-write]

Starts `shardwise-dashboard serve` (uvicorn, a fresh SQLite file) in a subprocess, then runs
two phases, each rank a thread of this process:
1. paced: every rank posts one step event every 1/rate s, with a 64-chunk snapshot every 10
   steps (what a rank's emitter sends at that pace: one small POST per step, a new connection
   per POST, as shardwise's HttpSink does); p50/p99 latency of a POST, from send to answer.
2. saturation: every rank posts batches of --batch step events back to back over one kept-
   alive connection; the events/s accepted is the ceiling of this machine.
After each phase the events stored in SQLite are counted against those the server accepted;
any difference is a loss and fails the run (exit 1). Writes its table into
benchmarks/RESULTS.md between the dashboard-load markers (only that block). Never imports
torch, like the dashboard.
"""

from __future__ import annotations

import argparse
import datetime
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

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- dashboard-load:begin -->", "<!-- dashboard-load:end -->"
NUM_CHUNKS = 64


@dataclass
class Tally:
    """What one phase sent and how long each POST took."""

    sent: int = 0
    accepted: int = 0
    failed_posts: int = 0
    latencies_s: list[float] = field(default_factory=list)
    late_posts: int = 0  # posts that left after their scheduled time had passed by a period
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, events: int, ok: bool, latency_s: float) -> None:
        with self.lock:
            self.sent += events
            self.latencies_s.append(latency_s)
            if ok:
                self.accepted += events
            else:
                self.failed_posts += 1


def step_event(run_id: str, rank: int, step: int) -> dict[str, Any]:
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
        "step_time_s": 0.1,
        "comm_bytes": {"all_gather": 2_000_000, "reduce_scatter": 1_000_000, "all_reduce": 8},
        "moved_bytes": {"to_device": 0, "to_host": 0},
        "memory": {"device": 40_000_000, "host": 0},
    }


def chunks_event(run_id: str, rank: int, step: int) -> dict[str, Any]:
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
                "payload": "device",
                "optim": "device",
                "tensor_states": {"free": 4},
            }
            for i in range(NUM_CHUNKS)
        ],
    }


def post_new_connection(url: str, events: list[dict[str, Any]]) -> bool:
    body = json.dumps({"events": events}).encode()
    request = urllib.request.Request(
        url + "/api/v1/events", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return response.status == 200
    except OSError:
        return False


def paced_rank(url: str, run_id: str, rank: int, rate: float, until: float, tally: Tally) -> None:
    period = 1.0 / rate
    start = time.perf_counter()
    step = 0
    while True:
        due = start + step * period
        now = time.perf_counter()
        if due >= until:
            return
        if due > now:
            time.sleep(due - now)
        elif now - due > period:
            with tally.lock:
                tally.late_posts += 1
        events = [step_event(run_id, rank, step)]
        if step % 10 == 0:
            events.append(chunks_event(run_id, rank, step))
        sent_at = time.perf_counter()
        ok = post_new_connection(url, events)
        tally.record(len(events), ok, time.perf_counter() - sent_at)
        step += 1


def saturating_rank(
    host: str, port: int, run_id: str, rank: int, batch: int, until: float, tally: Tally
) -> None:
    connection = http.client.HTTPConnection(host, port, timeout=10)
    step = 0
    try:
        while time.perf_counter() < until:
            events = [step_event(run_id, rank, step + i) for i in range(batch)]
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
            tally.record(len(events), ok, time.perf_counter() - sent_at)
            step += batch
    finally:
        connection.close()


def run_phase(workers: list[threading.Thread]) -> float:
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start


def stored_events(db: Path, run_id: str) -> int:
    with sqlite3.connect(db) as connection:
        return int(
            connection.execute(
                "SELECT count(*) FROM events WHERE run_id = ?", (run_id,)
            ).fetchone()[0]
        )


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


def summarise(name: str, tally: Tally, seconds: float, stored: int) -> dict[str, Any]:
    return {
        "phase": name,
        "events_sent": tally.sent,
        "events_accepted": tally.accepted,
        "events_stored": stored,
        "lost": tally.accepted - stored,
        "failed_posts": tally.failed_posts,
        "late_posts": tally.late_posts,
        "posts": len(tally.latencies_s),
        "seconds": round(seconds, 2),
        "events_per_s": round(tally.accepted / seconds, 1),
        "p50_ms": round(1000 * percentile(tally.latencies_s, 0.50), 2),
        "p99_ms": round(1000 * percentile(tally.latencies_s, 0.99), 2),
    }


def write_results(
    path: Path, command: str, args: argparse.Namespace, rows: list[dict[str, Any]], load: str
) -> None:
    lines = [
        BEGIN,
        "## Dashboard ingestion under load",
        "",
        f"Written by `{command}` on {datetime.date.today().isoformat()}: {machine()}; server "
        f"(uvicorn, one process) and {args.ranks} simulated ranks (threads of one client "
        f"process) on the same machine, over loopback, while other jobs shared it (load average "
        f"before the run: {load}, on {os.cpu_count()} cores).",
        "Paced: each rank posts one step event per step at the target rate, plus a "
        f"{NUM_CHUNKS}-chunk snapshot every 10 steps, one POST and one new connection per step "
        "(as a rank's emitter does at that rate). Saturation: each rank posts batches of "
        f"{args.batch} step events back to back on a kept-alive connection. Latency: one POST, "
        "send to answer (after the commit). Lost: accepted by the server but not in SQLite.",
        "",
        "| phase | target | events sent | accepted | stored | lost | failed POSTs | "
        "events/s accepted | p50 ms | p99 ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    targets = {
        "paced": f"{args.ranks} ranks x {args.rate:g} steps/s, {args.seconds:g} s",
        "saturation": f"{args.ranks} ranks, as fast as answered, {args.saturate_seconds:g} s",
    }
    for row in rows:
        lines.append(
            f"| {row['phase']} | {targets[row['phase']]} | {row['events_sent']:,} | "
            f"{row['events_accepted']:,} | {row['events_stored']:,} | {row['lost']} | "
            f"{row['failed_posts']} | {row['events_per_s']:,.1f} | {row['p50_ms']:.1f} | "
            f"{row['p99_ms']:.1f} |"
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
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rate", type=float, default=10.0, help="steps/s per rank (paced)")
    parser.add_argument("--seconds", type=float, default=15.0, help="paced phase length")
    parser.add_argument("--saturate-seconds", type=float, default=5.0, help="0 skips it")
    parser.add_argument("--batch", type=int, default=50, help="events per POST (saturation)")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if args.ranks < 1 or args.rate <= 0 or args.seconds <= 0 or args.batch < 1:
        parser.error(
            f"--ranks, --rate, --seconds, --batch must be positive, got {args.ranks}, "
            f"{args.rate}, {args.seconds}, {args.batch}"
        )
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    command = " ".join(["python benchmarks/bench_dashboard.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory() as scratch:
        db = Path(scratch) / "bench.sqlite"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(db, port)
        rows = []
        try:
            tally = Tally()
            until = time.perf_counter() + args.seconds
            seconds = run_phase(
                [
                    threading.Thread(
                        target=paced_rank, args=(url, "paced", r, args.rate, until, tally)
                    )
                    for r in range(args.ranks)
                ]
            )
            rows.append(summarise("paced", tally, seconds, stored_events(db, "paced")))
            if args.saturate_seconds > 0:
                tally = Tally()
                until = time.perf_counter() + args.saturate_seconds
                seconds = run_phase(
                    [
                        threading.Thread(
                            target=saturating_rank,
                            args=("127.0.0.1", port, "saturation", r, args.batch, until, tally),
                        )
                        for r in range(args.ranks)
                    ]
                )
                rows.append(
                    summarise("saturation", tally, seconds, stored_events(db, "saturation"))
                )
        finally:
            server.terminate()
            server.wait(timeout=10)
    print(json.dumps({"machine": machine(), "load_before": load, "phases": rows}, indent=2))
    if not args.no_write:
        write_results(args.results, command, args, rows, load)
    paced = rows[0]
    # Below the stated rate nothing may be lost or refused.
    if (
        any(row["lost"] for row in rows)
        or paced["failed_posts"]
        or paced["events_accepted"] != (paced["events_sent"])
    ):
        raise SystemExit("events were lost or refused: see the table above")


if __name__ == "__main__":
    main()
