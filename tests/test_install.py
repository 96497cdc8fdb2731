"""Installing the packages into an environment that has its own torch (docs/install.md): the
wheels built from packages/* go into a fresh virtual environment that sees this environment's
torch (and Lightning, transformers, FastAPI), and pip takes `torch>=2.6` as satisfied by it."""

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


PACKAGES = {  # directory: (distribution, module)
    "core": ("shardwise", "shardwise"),
    "lightning": ("shardwise_lightning", "shardwise_lightning"),
    "hf": ("shardwise_hf", "shardwise_hf"),
    "dashboard": ("shardwise_dashboard", "shardwise_dashboard"),
}


def test_every_wheel_installs_beside_an_existing_torch(tmp_path: Path) -> None:
    # The wheels, built as a user's `pip install ./packages/<name>` builds them (isolated,
    # hatchling fetched by pip). Without an index that has hatchling there is nothing to test.
    wheels = tmp_path / "wheels"
    for directory in PACKAGES:
        built = run(
            sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels,
            ROOT / "packages" / directory,
        )  # fmt: skip
        if built.returncode != 0:
            pytest.skip(
                f"cannot build the wheel here (no package index with hatchling?):\n{built.stderr}"
            )
    built_wheels = {d: next(wheels.glob(f"{dist}-*.whl")) for d, (dist, _) in PACKAGES.items()}

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

    # --no-index: torch>=2.6 (and each package's other requirements) must be found installed,
    # never fetched; shardwise-lightning and shardwise-hf find shardwise among the wheels.
    installed = run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "-q",
        *built_wheels.values(),
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr

    version = built_wheels["core"].name.split("-")[1]
    for directory, (_, module) in PACKAGES.items():
        imported = run(
            python, "-c", f"import {module}; print({module}.__version__); print({module}.__file__)"
        )
        assert imported.returncode == 0, (directory, imported.stderr)
        seen_version, location = imported.stdout.split()
        assert seen_version == version, directory
        assert Path(location).is_relative_to(target), f"imported {location}, not the wheel"

    cli = run(target / "bin" / "shardwise", "--version")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith(f"shardwise {version} (torch "), cli.stdout
