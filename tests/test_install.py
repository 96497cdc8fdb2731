"""Installing the core package into an environment that has its own torch (docs/install.md):
a wheel built from packages/core goes into a fresh virtual environment that sees this
environment's torch, and pip takes `torch>=2.6` as satisfied by it."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)


def run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=240
    )


def test_core_wheel_installs_beside_an_existing_torch(tmp_path: Path) -> None:
    # The wheel, built as a user's `pip install ./packages/core` builds it (isolated, hatchling
    # fetched by pip). Without an index that has hatchling there is nothing to test.
    wheels = tmp_path / "wheels"
    built = run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "-q",
        "-w",
        wheels,
        ROOT / "packages/core",
    )
    if built.returncode != 0:
        pytest.skip(
            f"cannot build the wheel here (no package index with hatchling?):\n{built.stderr}"
        )
    (wheel,) = wheels.glob("shardwise-*.whl")

    # A fresh environment whose only other packages are this one's (torch among them), as a
    # user's environment with its own torch build. A venv made from a venv's interpreter sees
    # the base interpreter's packages, not the venv's: a .pth line adds this one's.
    target = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(target)
    python = target / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    (Path(purelib.stdout.strip()) / "existing_env.pth").write_text(
        sysconfig.get_path("purelib") + "\n"
    )

    # --no-index: torch>=2.6 must be found installed, never fetched.
    installed = run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "-q", wheel
    )
    assert installed.returncode == 0, installed.stderr

    imported = run(
        python,
        "-c",
        "import shardwise, torch; print(shardwise.__version__); print(shardwise.__file__)",
    )
    assert imported.returncode == 0, imported.stderr
    version, location = imported.stdout.split()
    assert version == wheel.name.split("-")[1]
    assert Path(location).is_relative_to(target), f"imported {location}, not the installed wheel"

    cli = run(target / "bin" / "shardwise", "--version")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith(f"shardwise {version} (torch "), cli.stdout
