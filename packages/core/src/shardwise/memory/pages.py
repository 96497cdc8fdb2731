"""Host memory of the engine's own buffers: huge pages for them, and freed memory given back.

[Note: huge pages for the engine's buffers]
A sharded step on a CPU host allocates chunk-sized buffers over and over (gathered payloads,
gradient buffers), and the C library maps each large one fresh from the kernel, whose 4 KiB
pages fault and are zeroed on first write: a 256 MB buffer filled took 0.165 s, against
0.036 s in 2 MiB pages (this host). The engine asks the kernel for transparent huge pages on
each such buffer it allocates (`madvise(MADV_HUGEPAGE)` on its 2 MiB-aligned interior, before
anything writes to it), where the kernel grants them on request. That touches only the
engine's buffers: the process's allocator and its other tensors are left as they are (see
[Note: huge pages for host memory] in shardwise/host_memory.py for asking that of torch, for
every tensor). Buffers under 4 MiB are left alone (too small to hold an aligned huge page
worth the call).

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
import sys
from functools import cache
from typing import Any

import torch

from shardwise.host_memory import kernel_grants_huge_pages


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


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


@cache
def _madvise() -> Any:
    """libc's madvise where huge pages are granted on request, else None."""
    if not sys.platform.startswith("linux") or not kernel_grants_huge_pages():
        return None
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise"):
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(storage: torch.UntypedStorage) -> bool:
    """Ask for huge pages on `storage`'s memory (see [Note: huge pages for the engine's
    buffers]), before anything writes to it; whether it asked."""
    madvise = _madvise()
    nbytes = storage.nbytes()
    if madvise is None or storage.device.type != "cpu" or nbytes < 2 * _HUGE_PAGE:
        return False
    start = storage.data_ptr()
    begin = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    end = (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    return bool(madvise(begin, end - begin, _MADV_HUGEPAGE) == 0)


def give_back_freed_memory() -> bool:
    """Return the allocator's free memory to the system; whether it could be asked to."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
