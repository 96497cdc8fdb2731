"""Rank 0's random state, for every rank to build a sharded module from.

`model_sharded_context` builds modules with each rank keeping its slice of every parameter; the
values match those the same code gives unsharded only if every rank draws them from one random
state, rank 0's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank0_rng_states(device: torch.device) -> list[torch.Tensor]:
    """Rank 0's CPU random state, and its one of `device` when that is a GPU, on every rank
    (one broadcast when the process group is up). A collective: call it on every rank."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    if dist.is_initialized():
        dist.broadcast_object_list(states, src=0)
    return states


def set_rng_states(states: list[torch.Tensor], device: torch.device) -> None:
    """Make `states` (from `rank0_rng_states` on the same `device`) this rank's random state."""
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
