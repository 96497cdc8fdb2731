"""`import shardwise` and `shardwise --version` cost about what `import torch` costs (see
[Note: a lazy top level] in shardwise/__init__.py), and every public name is still there.

Times are wall clock of fresh interpreters, torch's and shardwise's taken in turn in the same
run (so a loaded machine slows both alike), compared by their medians."""

from __future__ import annotations

import ast
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardwise

TRIES = 5
# The bound: what shardwise adds to torch's import.
MARGIN_S = 0.5


def _wall_s(*args: str) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    return elapsed


def _medians(*commands: tuple[str, ...]) -> list[float]:
    """The median wall time of each command over TRIES rounds, the commands taken in turn
    within each round."""
    times: list[list[float]] = [[] for _ in commands]
    for _ in range(TRIES):
        for seen, command in zip(times, commands, strict=True):
            seen.append(_wall_s(*command))
    return [statistics.median(seen) for seen in times]


@pytest.mark.timeout(600)
def test_import_and_version_take_at_most_half_a_second_more_than_torch() -> None:
    torch_s, shardwise_s, version_s = _medians(
        ("-c", "import torch"),
        ("-c", "import shardwise"),
        ("-m", "shardwise.cli", "--version"),
    )
    said = f"import torch {torch_s:.2f} s, import shardwise {shardwise_s:.2f} s, "
    said += f"shardwise --version {version_s:.2f} s (medians of {TRIES})"
    assert shardwise_s - torch_s < MARGIN_S, said
    assert version_s - torch_s < MARGIN_S, said


def test_import_leaves_the_engine_and_its_heavy_torch_modules_unimported() -> None:
    # The deterministic face of the timing test: the modules that cost seconds stay out.
    probe = (
        "import sys, shardwise\n"
        "heavy = ('torch.distributed.checkpoint', 'torch._dynamo', 'shardwise.engine',"
        " 'shardwise.checkpoint', 'shardwise.zero')\n"
        "print(' '.join(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "", f"imported by `import shardwise`: {done.stdout}"


def test_every_public_name_resolves_to_its_module_object() -> None:
    import importlib

    for name in shardwise.__all__:
        value = getattr(shardwise, name)
        source = importlib.import_module(shardwise._SOURCES[name])
        expected = source if source.__name__ == f"shardwise.{name}" else getattr(source, name)
        assert value is expected, name
    assert set(shardwise.__all__) <= set(dir(shardwise))
    assert shardwise.booster.__name__ == "shardwise.booster"  # a subpackage, as an attribute
    with pytest.raises(AttributeError, match="no attribute 'zero_wrapper'"):
        _ = shardwise.zero_wrapper  # type: ignore[attr-defined]


def test_the_lazy_names_are_the_ones_type_checkers_read() -> None:
    # _SOURCES (read by the interpreter) and the imports under TYPE_CHECKING (read by mypy and
    # editors) name the same names from the same modules, and __all__ lists exactly those.
    tree = ast.parse(Path(shardwise.__file__).read_text())
    guarded = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    typed: dict[str, str] = {}
    for node in guarded.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            is_subpackage = node.module == "shardwise"
            typed[alias.name] = f"shardwise.{alias.name}" if is_subpackage else node.module
    assert typed == shardwise._SOURCES
    assert sorted(shardwise.__all__) == sorted(typed)
