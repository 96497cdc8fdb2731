"""Huge pages for large host-memory tensors, when a program asks for them.

[Note: huge pages for host memory]
torch's CPU allocator asks the kernel for transparent huge pages (`madvise(MADV_HUGEPAGE)`)
on allocations of 2 MiB and more when `THP_MEM_ALLOC_ENABLE=1`, which it reads once, at its
first allocation: a fresh 256 MB tensor then faults and is zeroed in 2 MiB pages, not 4 KiB
ones (filled: 0.04 s against 0.17 s). That is a setting of the whole process (every tensor of
every library in it, and the processes it starts), so shardwise does not make it on import:
the engine asks for huge pages on its own chunk-sized buffers only (see [Note: huge pages for
the engine's buffers] in memory/pages.py), and keeps freed ones for reuse on request (see
[Note: a pool of host buffers] in memory/buffer_pool.py). A program that wants huge pages for
every tensor sets the variable in its environment, or calls `prefer_huge_pages()` first thing,
before it builds a model or allocates any tensor (its effect reaches the processes it starts:
torchrun's workers, DataLoader workers); on a 117M GPT that made stage 3's step about a third
shorter (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def kernel_grants_huge_pages(mode_file: Path = THP_MODE) -> bool:
    """Whether transparent huge pages are granted on request (mode "always" or "madvise")."""
    try:
        mode = mode_file.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def prefer_huge_pages(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set THP_MEM_ALLOC_ENABLE=1 in `environ` (the process's) unless it is set already or the
    kernel would not grant huge pages (see [Note: huge pages for host memory]); whether it
    set it. Call it before anything allocates a tensor: torch reads the variable once."""
    environ = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or THP_VARIABLE in environ:
        return False
    if not kernel_grants_huge_pages():
        return False
    environ[THP_VARIABLE] = "1"
    return True
