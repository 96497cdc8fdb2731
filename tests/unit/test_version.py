"""The four packages carry one version number, read at runtime from their installed metadata,
and `shardwise --version` prints it with torch's."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise import cli

REPO = Path(__file__).resolve().parents[2]
# package folder -> (distribution, import name)
PACKAGES = {
    "core": ("shardwise", "shardwise"),
    "lightning": ("shardwise-lightning", "shardwise_lightning"),
    "hf": ("shardwise-hf", "shardwise_hf"),
    "dashboard": ("shardwise-dashboard", "shardwise_dashboard"),
}


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_version_attribute_is_the_installed_metadata(folder: str) -> None:
    distribution, module = PACKAGES[folder]
    installed = importlib.metadata.version(distribution)
    assert importlib.import_module(module).__version__ == installed
    # An editable install keeps the metadata of its last install: a stale one shows here.
    # (A pattern, not tomllib: Python 3.10 has none; `version` is the file's one such line.)
    pyproject = (REPO / "packages" / folder / "pyproject.toml").read_text()
    (declared,) = re.findall(r'^version = "([^"]+)"$', pyproject, flags=re.MULTILINE)
    assert installed == declared, (
        f"{distribution} is installed as {installed} but pyproject.toml says {declared}: "
        f"reinstall it (pip install --no-deps -e packages/{folder})"
    )


def test_the_four_packages_share_one_version() -> None:
    versions = {d: importlib.metadata.version(d) for d, _ in PACKAGES.values()}
    assert len(set(versions.values())) == 1, versions


def test_version_flag_prints_shardwise_and_torch_versions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == (
        f"shardwise {shardwise.__version__} (torch {torch.__version__})\n"
    )


def test_console_script_prints_the_version() -> None:
    # The `shardwise` entry point the install made, beside this interpreter.
    script = Path(sys.executable).parent / "shardwise"
    if not script.exists():
        pytest.skip(f"no console script at {script}")
    result = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"shardwise {shardwise.__version__} (torch {torch.__version__})\n"
