"""Starting the process group as a ColossalAI script does: `launch_from_torch()` under torchrun,
`launch(rank, world_size, host, port)` elsewhere (`colossalai.launch_from_torch`'s path and
arguments, with `shardwise` for `colossalai`)."""

from __future__ import annotations

import logging
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from shardwise import comm

_log = logging.getLogger(__name__)
_TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str | None = None,
    local_rank: int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: timedelta | None = None,
) -> None:
    """Initialise the default process group over TCP at `host:port`, select this rank's CUDA
    device and seed every generator (Python, NumPy, torch) with `seed`.

    Args:
        rank, world_size: this process's rank and the number of processes.
        host, port: where rank 0 listens.
        backend: "nccl" or "gloo"; None picks nccl when CUDA is available and gloo otherwise
            (ColossalAI always takes its accelerator's backend, whatever is passed).
        local_rank: this process's rank on its node, which selects the CUDA device.
        seed: the seed of every random generator, the same on every rank.
        verbose: log the world size on rank 0.
        timeout: the process group's timeout (torch's default when None).
    """
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised: launch() starts the process group, so "
            "call it once, before anything else initialises the group"
        )
    for name, value in (("rank", rank), ("world_size", world_size), ("port", port)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    backend = _backend(backend)
    if backend == "nccl" and local_rank is not None:
        torch.cuda.set_device(local_rank)
    address = f"[{host}]" if ":" in host else host  # an IPv6 address
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,  # None: the backend's default
    )
    comm.destroy_default_group_at_exit()  # see [Note: gloo at exit] in comm/lifecycle.py
    _seed_everything(seed)
    if verbose and rank == 0:
        _log.info("process group started: %d ranks, backend %s", world_size, backend)


def launch_from_torch(backend: str | None = None, seed: int = 1024, verbose: bool = True) -> None:
    """`launch` with the rank, world size and rendezvous address torchrun sets in the
    environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not set: launch_from_torch() reads what torchrun sets; start "
            f"the script with `torchrun --nproc-per-node=N script.py`, or call launch(rank, "
            f"world_size, host, port) with them yourself"
        )
    launch(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        host=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        backend=backend,
        local_rank=int(os.environ["LOCAL_RANK"]),
        seed=seed,
        verbose=verbose,
    )


def _backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend='nccl' needs CUDA, which is not available here: pass backend='gloo', or "
            "leave it out to pick gloo on a host without GPUs"
        )
    return backend


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's generator too


__all__ = ["launch", "launch_from_torch"]
