"""`shardwise-dashboard serve` binds its port before it announces its URL: a --port another
program holds stops it with one line (exit status 1), never an announcement followed by a bind
error; without --port, a taken 8265 moves it to the next free port, which the announcement
names; and the URL announced answers at once."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dashboard_support import free_port

from shardwise_dashboard.listen import FALLBACK_PORTS, PortBusy, bind


@contextmanager
def held(port: int) -> Iterator[socket.socket]:
    """`port` on 127.0.0.1 taken by another program's listening socket."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        yield other


@contextmanager
def serving(*command: str) -> Iterator[subprocess.Popen[str]]:
    """A dashboard process, killed after 60 s at most (or when the test is done)."""
    process = subprocess.Popen(
        [sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    watchdog = threading.Timer(60, process.kill)
    watchdog.start()
    try:
        yield process
    finally:
        watchdog.cancel()
        process.terminate()
        process.communicate(timeout=20)


def test_a_port_named_and_taken_stops_it_with_one_line(tmp_path: Path) -> None:
    port = free_port()
    serve = ["-m", "shardwise_dashboard", "serve", "--port", str(port), "--db"]
    with held(port), serving(*serve, str(tmp_path / "runs.sqlite")) as process:
        out, err = process.communicate(timeout=60)
    assert process.returncode == 1, (out, err)
    assert out == "", out  # no URL announced for a port it does not have
    assert err == (
        f"shardwise-dashboard: error: port {port} on 127.0.0.1 is in use (another dashboard, "
        f"or another program): stop it, or pass another port with --port\n"
    ), err


def test_the_default_port_taken_moves_to_the_next_free_one_and_says_so(tmp_path: Path) -> None:
    port = free_port()
    # The command line as a user runs it, with its default port pointed at one that is taken.
    start = (
        "import sys, shardwise_dashboard.cli as cli; "
        f"cli.DEFAULT_PORT = {port}; cli.main(sys.argv[1:])"
    )
    with held(port), serving("-c", start, "serve", "--db", str(tmp_path / "r.sqlite")) as process:
        assert process.stdout is not None
        announced = process.stdout.readline()
        hint = process.stdout.readline()
        url = announced.split()[3]
        # Bound before it was announced: it answers at once.
        with urllib.request.urlopen(url + "/api/v1/health", timeout=20) as response:
            assert response.status == 200
    moved = int(url.rsplit(":", 1)[1])
    assert port < moved <= port + FALLBACK_PORTS, announced
    assert announced.startswith(
        f"shardwise dashboard on http://127.0.0.1:{moved} (port {port} is in use)"
    ), announced
    assert hint.strip() == f"stream to it with SHARDWISE_DASHBOARD_URL=http://127.0.0.1:{moved}"


def test_bind_names_the_ports_it_tried() -> None:
    port = free_port()
    with held(port):
        try:
            bind("127.0.0.1", port, fallback=False)
            raise AssertionError("a taken port was bound")
        except PortBusy as error:
            assert f"port {port} on 127.0.0.1 is in use" in str(error)
        sock = bind("127.0.0.1", port, fallback=True)
        with sock:
            assert sock.getsockname()[1] != port
