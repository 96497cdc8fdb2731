"""Ending the default process group with the process.

[Note: gloo at exit]
A process that exits with its gloo process group still alive can abort in the group's C++
teardown ("terminate called without an active exception"): 2 of 6 two-rank runs of a
Trainer script that never destroyed the group did, and none that destroyed it first.
Frameworks that create the group (Lightning, the Hugging Face Trainer) leave it alive on gloo
(Lightning destroys it at exit for NCCL only), so once the engine is used it destroys the
default group when the interpreter exits, if it is still there. Exit handlers run last-in,
first-out: whatever registered after the engine (telemetry's final report) still has the group.
"""

from __future__ import annotations

import atexit
import os

import torch.distributed as dist
from torch.distributed import ProcessGroup

_registered = False


def destroy_default_group_at_exit() -> None:
    """Destroy the default process group at interpreter exit (registered once per process)."""
    global _registered
    if _registered:
        return
    _registered = True
    atexit.register(_destroy_if_alive)


def _destroy_if_alive() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_launched_group(group: ProcessGroup | None) -> None:
    """Refuse to shard for one process when the launcher started several: a model wrapped
    before `init_process_group` would shard for a world of 1 on every rank, and its first
    collective would then fail with a size mismatch far from the cause."""
    launched = os.environ.get("WORLD_SIZE", "1")
    if dist.is_available() and dist.is_initialized():
        return
    if group is not None:
        raise ValueError(
            "a process_group was given but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group() before wrapping the model"
        )
    if launched.isdigit() and int(launched) > 1:
        raise ValueError(
            f"the launcher started {launched} ranks (WORLD_SIZE={launched}) but "
            f"torch.distributed is not initialised yet: call "
            f"torch.distributed.init_process_group() before wrapping the model, so every rank "
            f"shards for the whole group"
        )
