"""`nox -s docs` leaves a site to open (site/, as README and docs/development.md say), and
`nox -s docs -- serve` serves it; run on a copy of what the build reads, so that the
repository's own site/ is left to its user."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOX = Path(sys.executable).parent / "nox"

# As ./dev runs nox: this environment's tools (mkdocs) first on PATH.
ENV = {**os.environ, "PATH": f"{NOX.parent}{os.pathsep}{os.environ.get('PATH', '')}"}

pytestmark = pytest.mark.skipif(not NOX.exists(), reason=f"no nox beside {sys.executable}")


def _copy_of_the_docs(target: Path) -> Path:
    """mkdocs.yml, docs/, the noxfile and the sources the API reference is read from."""
    for name in ("mkdocs.yml", "noxfile.py"):
        shutil.copy(ROOT / name, target / name)
    shutil.copytree(ROOT / "docs", target / "docs")
    for package in (ROOT / "packages").iterdir():
        if (package / "src").is_dir():
            shutil.copytree(
                package / "src",
                target / "packages" / package.name / "src",
                ignore=shutil.ignore_patterns("__pycache__"),
            )
    return target


def test_the_docs_session_leaves_a_site_to_open(tmp_path: Path) -> None:
    tree = _copy_of_the_docs(tmp_path)
    built = subprocess.run(
        [str(NOX), "-f", str(tree / "noxfile.py"), "-s", "docs"],
        capture_output=True, text=True, timeout=240, env=ENV,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    site = tree / "site"
    assert (site / "index.html").is_file()
    assert (site / "api" / "shardwise" / "index.html").is_file()
    # It says where the site is and how to serve it.
    assert "open site/index.html" in built.stderr and "-- serve" in built.stderr, built.stderr


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_docs_session_serves_the_site(tmp_path: Path) -> None:
    tree = _copy_of_the_docs(tmp_path)
    address = f"127.0.0.1:{_free_port()}"
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [str(NOX), "-f", str(tree / "noxfile.py"), "-s", "docs", "--", "serve",
         "--dev-addr", address],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=ENV,
    )  # fmt: skip
    try:
        page, deadline = "", time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://{address}/", timeout=5) as response:
                    page = response.read().decode()
                break
            except OSError:
                time.sleep(0.5)
        assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        assert "<title>" in page and "shardwise" in page, page[:500]
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have ended already
            os.killpg(server.pid, signal.SIGTERM)  # nox and the mkdocs it started
        server.wait(timeout=30)
        log.close()
