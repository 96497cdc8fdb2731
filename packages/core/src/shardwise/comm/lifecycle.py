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

import torch.distributed as dist

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
