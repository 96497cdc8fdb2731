"""Gradient norm over shards that together make the whole gradient."""

from __future__ import annotations

import math

import torch
from torch.distributed import ProcessGroup, ReduceOp

from shardwise import comm
from shardwise.comm import CommStats


def global_grad_norm(
    grad_shards: list[torch.Tensor],
    norm_type: float,
    stats: CommStats,
    group: ProcessGroup | None,
) -> float:
    """The `norm_type` norm of the gradient whose disjoint pieces are this rank's `grad_shards`
    and the other ranks' (padding is zero, so it changes nothing). inf or nan when any rank's
    gradient holds one: that is how an overflow is found, everywhere at once."""
    device = grad_shards[0].device if grad_shards else torch.device("cpu")
    if not grad_shards:
        # Nothing trainable on this model: still join the collective every rank issues.
        grad_shards = [torch.zeros(1, device=device)]
    if math.isinf(norm_type):
        local = (
            torch.stack([g.abs().max() for g in grad_shards if g.numel()]).max()
            if any(g.numel() for g in grad_shards)
            else torch.zeros((), device=device)
        )
        # max() drops nan; carry it in a second slot so an overflow is never missed.
        flags = torch.stack(
            [local, torch.stack([g.isnan().any() for g in grad_shards]).any().float()]
        )
        comm.all_reduce(flags, stats, group, op=ReduceOp.MAX)
        return math.nan if flags[1].item() > 0 else float(flags[0].item())
    norms = torch._foreach_norm(grad_shards, norm_type)
    local_sum = torch.stack([n.double() for n in norms]).pow(norm_type).sum()
    comm.all_reduce(local_sum, stats, group)
    total: float = float(local_sum.item()) ** (1.0 / norm_type)
    return total
