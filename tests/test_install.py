"""Installing the packages into an environment that has its own torch, on a host with no
package index (docs/install.md, "On a host with no package index"): the wheels built from
packages/* where an index is, then installed from their folder with `--no-index` into a fresh
virtual environment that sees this environment's torch (and tqdm, Lightning, transformers,
FastAPI), pip taking `torch>=2.6` as satisfied by it. A source install there fails for want of
the build backend, which is why the wheels travel."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(300)

PACKAGES = {  # directory: (distribution, module)
    "core": ("shardwise", "shardwise"),
    "lightning": ("shardwise_lightning", "shardwise_lightning"),
    "hf": ("shardwise_hf", "shardwise_hf"),
    "dashboard": ("shardwise_dashboard", "shardwise_dashboard"),
}


def run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`args` run with `env`, by default this process's environment without PYTHONPATH (a
    source tree on it, as on a machine that runs the packages from the clone, would be
    imported in place of what the fresh environment installed)."""
    if env is None:
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=240, env=env
    )


def _offline() -> dict[str, str]:
    """This process's environment as a host with no package index has it: none of pip's index,
    find-links or constraint settings, no pip configuration file, no PYTHONPATH."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("PIP_") and key != "PYTHONPATH"
    }
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _fresh_env(target: Path) -> Path:
    """A fresh virtual environment that sees this one's packages but shardwise's (torch among
    them), as a host's environment made with `--system-site-packages` sees the host's torch.
    A venv made from a venv's interpreter sees the base interpreter's packages, not the venv's:
    a .pth line adds a folder of links to this one's, less the four packages (installed here
    editable, pip would take them as installed). Returns its python."""
    venv.EnvBuilder(with_pip=False).create(target)
    host = target / "host-packages"
    host.mkdir()
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        if "shardwise" not in entry.name.lower():
            (host / entry.name).symlink_to(entry)
    python = target / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))")
    (Path(purelib.stdout.strip()) / "host_packages.pth").write_text(f"{host}\n")
    return python


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four wheels, built as docs/install.md says on a machine with an index (hatchling
    fetched by pip's build isolation). Without such an index there is nothing to test."""
    folder = tmp_path_factory.mktemp("wheels")
    sources = [ROOT / "packages" / directory for directory in PACKAGES]
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", folder, *sources)
    if built.returncode != 0:
        pytest.skip(
            f"cannot build the wheels here (no package index with hatchling?):\n{built.stderr}"
        )
    return folder


def test_a_source_install_without_an_index_lacks_the_build_backend(tmp_path: Path) -> None:
    # What a GPU host with no index meets: pip cannot fetch hatchling to build from source.
    python = _fresh_env(tmp_path / "env")
    source = run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-index",
        ROOT / "packages" / "core", env=_offline(),
    )  # fmt: skip
    assert source.returncode != 0
    assert "hatchling" in source.stderr, source.stderr


def test_the_wheels_install_offline_beside_an_existing_torch(wheels: Path, tmp_path: Path) -> None:
    built = {d: next(wheels.glob(f"{dist}-*.whl")) for d, (dist, _) in PACKAGES.items()}
    # Pure Python, as docs/install.md says: one set of wheels serves every host.
    assert all(wheel.name.endswith("-py3-none-any.whl") for wheel in built.values()), built
    python = _fresh_env(tmp_path / "env")
    # As docs/install.md says: the folder of wheels, the distributions by name, no index.
    # torch>=2.6 (and each package's other requirements) must be found installed, never
    # fetched; shardwise-lightning and shardwise-hf find shardwise in the folder.
    installed = run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-index",
        "--find-links", wheels, "-q", *(dist.replace("_", "-") for dist, _ in PACKAGES.values()),
        env=_offline(),
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr

    version = built["core"].name.split("-")[1]
    for directory, (_, module) in PACKAGES.items():
        imported = run(
            python, "-c", f"import {module}; print({module}.__version__); print({module}.__file__)"
        )
        assert imported.returncode == 0, (directory, imported.stderr)
        seen_version, location = imported.stdout.split()
        assert seen_version == version, directory
        assert Path(location).is_relative_to(tmp_path / "env" / "lib"), (
            f"imported {location}, not the wheel"
        )

    cli = run(tmp_path / "env" / "bin" / "shardwise", "--version")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith(f"shardwise {version} (torch "), cli.stdout
