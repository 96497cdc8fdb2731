"""Sessions for the shardwise monorepo.

They run in the environment `./dev` prepares (.venv: torch 2.13 CPU, the packages installed
editable, the tools), so no session downloads a second copy of torch: run them as
`./dev nox -s <session>`, or `nox` inside an activated .venv.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "typecheck", "tests"]

# Where `nox -s docs` leaves the site: mkdocs.yml's site_dir (gitignored).
SITE = "site"

PACKAGES = [
    "packages/core/src",
    "packages/lightning/src",
    "packages/hf/src",
    "packages/dashboard/src",
]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over packages, tests, benchmarks and examples."""
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the packages' sources."""
    session.run("mypy", *PACKAGES)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite: unit, multi-rank (gloo, forked ranks) and end-to-end."""
    session.run("python", "-m", "pytest", *(session.posargs or ["tests"]))
    # The docs build runs after the tests, so `./dev test` checks the site too (the tests'
    # arguments are not its own).
    session.notify("docs", posargs=[])


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site, `mkdocs build --strict` from mkdocs.yml into its site_dir,
    site/ (gitignored), left there to open (site/index.html): a broken link between pages or
    an API name that no longer exists fails it. Arguments go to `mkdocs build`
    (`-- --site-dir DIR` builds elsewhere); `-- serve` serves the site instead at
    http://127.0.0.1:8000, rebuilt as the pages change (`-- serve --dev-addr ADDRESS:PORT`)."""
    env = {"NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's notice about its successor
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", "--strict", *session.posargs[1:], env=env)
        return
    # mkdocs counts no warning under --quiet: keep its INFO lines.
    session.run("mkdocs", "build", "--strict", *session.posargs, env=env)
    if not session.posargs:
        session.log(
            f"the site is in {SITE}/: open {SITE}/index.html in a browser, or serve it with "
            f"./dev nox -s docs -- serve"
        )


@nox.session
def demo(session: nox.Session) -> None:
    """Train a small GPT with ZeRO stage 3 on 2 CPU ranks under torchrun, live in the dashboard.

    Starts the dashboard on a free loopback port (8265 when free; history in
    runs/dashboard.sqlite), prints its URL, streams the run into it, then keeps it up for
    --hold seconds (default 30; 0 ends at once; Ctrl-C ends early) and stops it. Options:
    `./dev demo --hold 0 --port 8300 --steps 100` (the others go to examples/train_gpt.py).
    """
    import argparse
    import contextlib
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    def free_port(preferred: int) -> int:
        for candidate in (preferred, 0):
            with socket.socket() as probe:
                # As uvicorn binds: a port whose old connections linger in TIME_WAIT is free.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("127.0.0.1", candidate))
                except OSError:
                    continue
                return int(probe.getsockname()[1])
        raise AssertionError("no free port on 127.0.0.1")

    parser = argparse.ArgumentParser(prog="./dev demo", add_help=False)
    parser.add_argument("--hold", type=float, default=30.0)
    parser.add_argument("--port", type=int, default=0)
    options, train_args = parser.parse_known_args([a for a in session.posargs if a != "--"])
    if options.hold < 0:
        session.error(f"--hold must be >= 0 seconds, got {options.hold}")
    port = options.port or free_port(8265)
    url = f"http://127.0.0.1:{port}"
    db = "runs/dashboard.sqlite"
    serve = [sys.executable, "-m", "shardwise_dashboard", "serve", "--port", str(port)]
    dashboard = subprocess.Popen([*serve, "--db", db])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/api/v1/health", timeout=1):
                    break
            except OSError:
                if dashboard.poll() is not None or time.monotonic() > deadline:
                    session.error(f"the dashboard did not start on {url} (see above)")
                time.sleep(0.1)
        session.log(f"dashboard: open {url} to watch the run live")
        session.run(
            "torchrun",
            "--standalone",
            "--nproc-per-node=2",
            "examples/train_gpt.py",
            *train_args,
            env={"OMP_NUM_THREADS": "1", "SHARDWISE_DASHBOARD_URL": url},
        )
        if options.hold:
            session.log(
                f"training done; the dashboard stays at {url} for {options.hold:g} s "
                f"(Ctrl-C stops it now). Later: shardwise-dashboard serve --db {db}"
            )
            with contextlib.suppress(KeyboardInterrupt):
                time.sleep(options.hold)
    finally:
        dashboard.terminate()
        try:
            dashboard.wait(timeout=10)
        except subprocess.TimeoutExpired:
            dashboard.kill()
            dashboard.wait()
        session.log("dashboard stopped")


@nox.session
def build(session: nox.Session) -> None:
    """Wheels of the four packages in dist/ (hatchling, fetched by pip's build isolation)."""
    for package in ("core", "lightning", "hf", "dashboard"):
        session.run("pip", "wheel", "--no-deps", "-q", "-w", "dist", f"packages/{package}")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against torch DDP and FSDP2, then the dashboard's ingestion under load; both
    write benchmarks/RESULTS.md (the suite keeps the load test's block)."""
    session.run("python", "benchmarks/suite.py", *session.posargs)
    session.run("python", "benchmarks/bench_dashboard.py")
