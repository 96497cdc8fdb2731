"""Sessions for the shardwise monorepo.

They run in the environment `./dev` prepares (.venv: torch 2.13 CPU, the packages installed
editable, the tools), so no session downloads a second copy of torch: run them as
`./dev nox -s <session>`, or `nox` inside an activated .venv.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "typecheck", "tests"]

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


@nox.session
def demo(session: nox.Session) -> None:
    """Train a small GPT with ZeRO stage 3 on 2 CPU ranks under torchrun."""
    session.run(
        "torchrun",
        "--standalone",
        "--nproc-per-node=2",
        "examples/train_gpt.py",
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against torch DDP and FSDP2; writes benchmarks/RESULTS.md."""
    session.run("python", "benchmarks/suite.py", *session.posargs)
