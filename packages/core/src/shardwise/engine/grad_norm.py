"""Gradient norm over shards that together make the whole gradient, and what rides with it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup, ReduceOp

from shardwise import comm
from shardwise.comm import CommStats


@dataclass(frozen=True, slots=True)
class StepReduction:
    """What the step's one all-reduce found.

    Attributes:
        norm: the global gradient norm (inf or nan when any rank's gradient holds one).
        ranks_agree: every rank passed the same `signature`.
        got_grad: per tensor, whether some rank's gradient reached it (the `got_grad` flags
            combined over ranks).
    """

    norm: float
    ranks_agree: bool
    got_grad: list[bool]


def global_grad_norm(
    grad_shards: list[torch.Tensor],
    norm_type: float,
    stats: CommStats,
    group: ProcessGroup | None,
    device: torch.device,
    *,
    signature: Sequence[float] = (),
    got_grad: Sequence[bool] = (),
    replicas: int = 1,
    partials: Sequence[torch.Tensor | None] = (),
) -> StepReduction:
    """The `norm_type` norm of the gradient whose disjoint pieces are this rank's `grad_shards`
    and the other ranks' (padding is zero, so it changes nothing). inf or nan when any rank's
    gradient holds one: that is how an overflow is found, everywhere at once.

    Two things ride in the same all-reduce: `signature` (small integers, e.g. pass counters;
    see [Note: ranks in step] in runtime/rank_sync.py), and `got_grad`, this rank's flag per
    tensor (see [Note: tensors without gradients] in engine/optimizer.py).

    Under hybrid sharding `group` is every rank and each shard is held by `replicas` of them:
    each rank's sum is divided by that count (exact for a power of two).

    `partials`, one per shard where given, are shares of a finite-`norm_type` norm taken when
    the shard's reduction was accepted (see [Note: norm partials] in chunk/norm_partial.py): the
    shard itself is not read where its share is there.

    The reduction travels on `device`, the model's compute device (NCCL's tensors live on
    the GPU), wherever the shards are."""
    if not grad_shards:
        # Nothing trainable on this model: still join the collective every rank issues.
        grad_shards = [torch.zeros(1, device=device)]
    mine = torch.tensor(list(signature), dtype=torch.float64, device=device)
    flags = torch.tensor(list(got_grad), dtype=torch.float64, device=device)
    count = len(signature)
    if math.isinf(norm_type):
        local = (
            torch.stack([g.abs().max().to(device) for g in grad_shards if g.numel()]).max()
            if any(g.numel() for g in grad_shards)
            else torch.zeros((), device=device)
        )
        # max() drops nan; carry it in a second slot so an overflow is never missed. The
        # signature travels as itself and negated: MAX then gives its maximum and minimum.
        nan_flag = torch.stack([g.isnan().any().to(device) for g in grad_shards]).any()
        packed = torch.cat([torch.stack([local.double(), nan_flag.double()]), mine, -mine, flags])
        comm.all_reduce(packed, stats, group, op=ReduceOp.MAX)
        highest, lowest = packed[2 : 2 + count], -packed[2 + count : 2 + 2 * count]
        norm = math.nan if packed[1].item() > 0 else float(packed[0].item())
        return StepReduction(
            norm, bool(torch.equal(highest, lowest)), _flags(packed[2 + 2 * count :])
        )
    norms = _shard_norms(grad_shards, norm_type, partials)
    local_sum = torch.stack(_powered_sums(norms, norm_type, device)).sum() / replicas
    # Under SUM the signature travels with its squares: n * sum(s^2) == sum(s)^2 holds only
    # when every rank's s is the same (exact in float64 for counters below 2**20).
    packed = torch.cat([local_sum.reshape(1), mine, mine * mine, flags])
    comm.all_reduce(packed, stats, group)
    sums, squares = packed[1 : 1 + count], packed[1 + count : 1 + 2 * count]
    agreed = bool(torch.equal(sums * sums, squares * comm.world_size(group)))
    norm = float(packed[0].item()) ** (1.0 / norm_type)
    return StepReduction(norm, agreed, _flags(packed[1 + 2 * count :]))


def _shard_norms(
    grad_shards: list[torch.Tensor],
    norm_type: float,
    partials: Sequence[torch.Tensor | None],
) -> list[torch.Tensor]:
    """Each shard's `norm_type` norm, in shard order: its partial where there is one, else
    read from the shard (per device, in one foreach kernel)."""
    norms: list[torch.Tensor | None] = list(partials) or [None] * len(grad_shards)
    by_device: dict[torch.device, list[int]] = {}
    for index, (shard, norm) in enumerate(zip(grad_shards, norms, strict=True)):
        if norm is None:
            by_device.setdefault(shard.device, []).append(index)
    for indices in by_device.values():
        computed = torch._foreach_norm([grad_shards[i] for i in indices], norm_type)
        for index, norm in zip(indices, computed, strict=True):
            norms[index] = norm
    return [norm for norm in norms if norm is not None]


def _powered_sums(
    norms: list[torch.Tensor], norm_type: float, device: torch.device
) -> list[torch.Tensor]:
    """Per device that holds norms ("auto" placement mixes host and device chunks), the sum
    of the norms to the `norm_type`, in shard order, in float64 on `device`."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for norm in norms:
        by_device.setdefault(norm.device, []).append(norm)
    return [
        torch.stack(on_device).double().pow(norm_type).sum().to(device)
        for on_device in by_device.values()
    ]


def _flags(values: torch.Tensor) -> list[bool]:
    return [bool(v) for v in (values > 0).tolist()]
