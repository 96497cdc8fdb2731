"""A chunk's share of the step's gradient norm, taken where its reduction ran.

[Note: norm partials]
The step needs the global norm of the gradient before any chunk steps (clipping, and the
overflow check of fp16). Read from the shards at the step, it reads every shard, which under
offload live in host memory: every chunk's host step would wait for all of them. So where a
chunk's shard holds exactly one reduction since zero_grad() (the usual step: one
synchronised backward), its share of the norm (the p-norm of its reduced slice) is taken as
that reduction is accepted, on the device where the reduction ran, from the same fp32 values
the shard receives; the step sums the shares (engine/grad_norm.py). A second reduction added
into the shard (backward passes accumulating outside no_sync) or a change of the shard
across replicas (hybrid sharding) drops the share, and the step reads that shard. The
infinity norm, which must also carry NaN apart, is always read from the shards. Each share is
the kernel the step would run over the same values, so the norm is the same bit for bit.
"""

from __future__ import annotations

import math

import torch


def norm_partial(reduced: torch.Tensor, norm_type: float | None) -> torch.Tensor | None:
    """`reduced`'s share of the step's `norm_type` norm (see [Note: norm partials])."""
    if norm_type is None or math.isinf(norm_type):
        return None
    return torch._foreach_norm([reduced.to(torch.float32)], norm_type)[0]


__all__ = ["norm_partial"]
