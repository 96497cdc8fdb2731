"""Giving freed host memory back to the operating system.

[Note: freed memory goes back]
The disk tier frees each chunk's master and optimizer state after writing them (their storage
resized to zero) and allocates them again to read them back, chunk after chunk. glibc serves
those allocations from its heap once it has raised its mmap threshold past their size (it does
so the first time it frees a large mapped block), and keeps freed heap memory for later use:
the process's resident set then holds most of what the step freed, and the host memory the
disk tier was meant to spare is not spared. `malloc_trim(0)` returns the heap's free pages to
the system (glibc 2.8 and later release free pages inside the heap too, not only at its top);
the disk tier's step calls it once it has written its chunks out. Elsewhere than glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Any


@cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def give_back_freed_memory() -> bool:
    """Return the allocator's free memory to the system; whether it could be asked to."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
