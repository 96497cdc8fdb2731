"""`spawn` and `free_port` (`colossalai.testing`'s): start ranks as fresh processes that call
`func(rank, world_size=..., port=..., **kwargs)`; `func` calls `shardwise.launch(...)` with
them. (The suite's own multi-rank tests fork through `run_ranks`, which is faster.)"""

from __future__ import annotations

import functools
import random
import socket
from collections.abc import Callable
from typing import Any

from torch.multiprocessing.spawn import spawn as torch_spawn


def free_port() -> int:
    """A port on localhost nothing is bound to now."""
    while True:
        port = random.randint(20000, 65000)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("localhost", port))
            except OSError:
                continue
            return port


def spawn(func: Callable[..., Any], nprocs: int = 1, **kwargs: Any) -> None:
    """Run `func(rank, world_size=nprocs, port=<a free port>, **kwargs)` in `nprocs` spawned
    processes and wait for them; a rank's exception is raised here
    (`torch.multiprocessing.ProcessRaisedException`).

    Args:
        func: the per-rank function (picklable: defined at a module's top level).
        nprocs: the number of ranks.
        **kwargs: passed to `func`.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    torch_spawn(
        functools.partial(func, world_size=nprocs, port=free_port(), **kwargs), nprocs=nprocs
    )
