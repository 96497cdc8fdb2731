"""Model-state bytes per rank: the ZeRO paper's analysis, and what this engine holds.

The ZeRO analysis (Rajbhandari et al., 2020, section 5): with Psi parameters, N ranks,
parameters and gradients of `param_bytes` and `grad_bytes` each, and K bytes of optimizer state
per parameter (mixed-precision Adam: K = 12, the fp32 master and two fp32 moments),

    DDP      (param_bytes + grad_bytes + K) Psi
    stage 1  (param_bytes + grad_bytes) Psi + K Psi / N
    stage 2  param_bytes Psi + (grad_bytes + K) Psi / N
    stage 3  (param_bytes + grad_bytes + K) Psi / N

This engine differs in two documented places: the gradient shard the optimizer reads is always
fp32 (so accumulation and unscaling happen in fp32), and stage 1 keeps that shard beside the
whole local gradient unless the reduction is fp32 too (then the shard is this rank's slice of
the whole gradient buffer). Its parameters are padded per chunk to a multiple of N.
"""

from __future__ import annotations

from dataclasses import dataclass

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True, kw_only=True, slots=True)
class StateBytes:
    """Model-state bytes one rank holds, by kind."""

    params: float
    grads: float
    optimizer: float
    master: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.master


def zero_paper_bytes(
    stage: int,
    psi: float,
    world_size: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    k: int = 12,
) -> float:
    """Bytes per rank by the ZeRO paper's formula (stage 0 is plain data parallelism)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    sharded_params = psi / n if stage == 3 else psi
    sharded_grads = psi / n if stage >= 2 else psi
    sharded_optim = psi / n if stage >= 1 else psi
    return param_bytes * sharded_params + grad_bytes * sharded_grads + k * sharded_optim


def engine_bytes(
    stage: int,
    psi_padded: float,
    world_size: int,
    *,
    param_bytes: int,
    compute_bytes: int,
    reduce_bytes: int,
    optimizer_bytes_per_param: int,
) -> StateBytes:
    """What this engine holds per rank between steps (stage 0 is torch DDP, for comparison).

    Args:
        stage: 0-3.
        psi_padded: parameters including chunk padding.
        world_size: N.
        param_bytes: bytes of the stored parameter dtype.
        compute_bytes: bytes of the compute dtype (a compute copy is kept whole at stages 1-2
            when it differs from the stored dtype).
        reduce_bytes: bytes of the gradient-reduction dtype (stage 1's whole local gradient).
        optimizer_bytes_per_param: optimizer state per parameter (Adam: 8).
    """
    n = world_size
    if stage == 0:
        # Replicated data parallelism with the same precision: a whole fp32 master when the
        # parameters are 16-bit.
        return StateBytes(
            params=param_bytes * psi_padded,
            grads=param_bytes * psi_padded,
            optimizer=optimizer_bytes_per_param * psi_padded,
            master=0.0 if param_bytes == 4 else 4 * psi_padded,
        )
    shard = psi_padded / n
    master = 0.0 if param_bytes == 4 else 4 * shard
    if stage == 3:
        params = param_bytes * shard
    else:
        params = param_bytes * psi_padded
        if compute_bytes != param_bytes:
            params += compute_bytes * psi_padded
    grads = 4 * shard
    if stage == 1:
        # The fp32 shard lives inside an fp32 whole gradient (Chunk.share_grad_shard_with_full,
        # Chunk.keep_averaged_grads).
        grads = reduce_bytes * psi_padded + (0.0 if reduce_bytes == 4 else grads)
    return StateBytes(
        params=params, grads=grads, optimizer=optimizer_bytes_per_param * shard, master=master
    )
