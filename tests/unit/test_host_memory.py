"""Huge pages for large host tensors, on request: importing shardwise leaves the process's
allocator alone; `prefer_huge_pages()` sets THP_MEM_ALLOC_ENABLE=1 where the process has not
chosen and the kernel grants huge pages on request, and leaves a choice alone (see [Note: huge
pages for host memory] in shardwise/host_memory.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.host_memory import THP_VARIABLE, kernel_grants_huge_pages, prefer_huge_pages


@pytest.mark.parametrize(
    ("mode", "granted"),
    [
        ("always [madvise] never\n", True),
        ("[always] madvise never\n", True),
        ("always madvise [never]\n", False),
    ],
)
def test_the_kernels_mode_decides(tmp_path: Path, mode: str, granted: bool) -> None:
    mode_file = tmp_path / "enabled"
    mode_file.write_text(mode)
    assert kernel_grants_huge_pages(mode_file) is granted
    assert kernel_grants_huge_pages(tmp_path / "missing") is False  # no such kernel knob


def test_a_choice_already_made_is_kept() -> None:
    for chosen in ("0", "1"):
        environ = {THP_VARIABLE: chosen}
        assert prefer_huge_pages(environ) is False
        assert environ == {THP_VARIABLE: chosen}


def test_importing_shardwise_leaves_the_allocator_alone() -> None:
    # In a fresh interpreter, torch imported first and then shardwise, as users write it.
    code = "import os, torch, shardwise; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    assert _printed_by_a_fresh_interpreter(code) == "None"


@pytest.mark.skipif(not kernel_grants_huge_pages(), reason="the kernel grants no huge pages")
def test_asked_for_it_is_set_where_unset() -> None:
    environ: dict[str, str] = {}
    assert prefer_huge_pages(environ) is True
    assert environ == {THP_VARIABLE: "1"}
    code = (
        "import os, shardwise; shardwise.prefer_huge_pages(); import torch; torch.ones(1); "
        "print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    )
    assert _printed_by_a_fresh_interpreter(code) == "1"


def _printed_by_a_fresh_interpreter(code: str) -> str:
    """What `code` prints in a new interpreter whose environment has no THP variable."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()
