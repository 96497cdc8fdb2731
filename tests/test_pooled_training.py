"""Training with the pool of host buffers (see [Note: a pool of host buffers] in
chunk/buffer_pool.py) on 2 ranks, every buffer filled with NaN as the pool takes it, so that a
read of memory the pool handed out before it was written would show in the losses and weights:
with a branch some ranks skip (parts of gradient buffers unwritten) and clipping (which reads
every element of the shards). Against the plain torch loop at stages 2 and 3 within
tests/test_parity.py's clipping tolerances (the global norm is summed in another order than
clip_grad_norm_ does); a pooled run against an unpooled one with 16-bit storage, bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import BranchyGPT, Run, adamw, batch_slice, make_model, max_abs_diff, reference

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.chunk.buffer_pool import BufferPool, pool_supported
from shardwise.testing import run_ranks

pytestmark = pytest.mark.skipif(not pool_supported(), reason="this torch cannot move memory")

# One chunk for the whole model: the branch's parameters share it with parameters every rank's
# gradient reaches, so on a rank that skips the branch part of the gradient buffer is unwritten,
# and every buffer of a step is the size of one the step before freed.
CHUNK_NUMEL = 1 << 16
# tests/test_parity.py's, for clipping.
PARAM_TOL = 1e-4
LOSS_TOL = 1e-5


def _poison_what_it_keeps(pool: BufferPool) -> None:
    """Fill every buffer with NaN as the pool takes it (fp32 and bf16 alike: all bits set)."""
    keep = pool.free

    def free(tensor: torch.Tensor) -> None:
        keep(tensor)
        for spares in pool._spares.values():  # the pool's own, which no tensor views
            for storage in spares:
                torch.tensor([], dtype=torch.uint8).set_(storage).fill_(0xFF)

    pool.free = free  # type: ignore[method-assign]


def _train(run: Run, pool: bool) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    rank = dist.get_rank()
    model = make_model(run.branch)
    config: dict[str, Any] = {
        "device": torch.device("cpu"),
        "mixed_precision": run.mixed_precision,
        "host_buffer_pool": pool,
    }
    if run.stage == 3:
        # The model, which calls the branch on some ranks only, is gathered as one conditional
        # unit (see [Note: conditional units] in runtime/gather_units.py).
        config.update(chunk_size_numel=CHUNK_NUMEL, gather_units=(BranchyGPT,))
    wrapped = zero_model_wrapper(model, run.stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        adamw(model.parameters()),
        max_norm=run.max_norm,
        optim_config={"reduce_bucket_size": CHUNK_NUMEL} if run.stage < 3 else None,
    )
    buffers = wrapped.chunk_manager.buffer_pool
    if buffers is not None:
        _poison_what_it_keeps(buffers)
    losses = []
    for step in range(run.steps):
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, run.world))
        optimizer.backward(loss)
        total = loss.detach().float()
        dist.all_reduce(total)
        optimizer.step()
        losses.append(float(total / run.world))
    state = wrapped.state_dict(only_rank_0=False)
    counts = {
        "reused": buffers.reused if buffers is not None else 0,
        "spare": wrapped.pooled_bytes(),
        "limit": buffers.spare_limit_bytes if buffers is not None else 0,
    }
    wrapped.release_module()
    counts["spare_after_release"] = buffers.spare_bytes if buffers is not None else 0
    return losses, state, counts


@pytest.mark.parametrize("stage", [2, 3])
def test_a_pooled_run_equals_the_torch_loop_in_fp32(stage: int) -> None:
    # A branch some ranks skip leaves parts of gradient buffers unwritten, and clipping reads
    # every element of the shards: what the pool handed out unwritten would reach the results.
    run = Run(stage=stage, steps=4, branch="some_ranks", max_norm=1.0)
    expected_losses, expected_state = reference(run)
    for losses, state, counts in run_ranks(_train, 2, run, True):
        assert losses == pytest.approx(expected_losses, abs=LOSS_TOL)
        assert max_abs_diff(state, expected_state) < PARAM_TOL
        assert counts["reused"] > 0  # buffers did come from the pool
        # What is spare at the end depends on when the last reductions' gloo work let go of
        # their buffers (one still viewed is not taken back); never more than the limit.
        assert counts["spare"] <= counts["limit"]
        assert counts["spare_after_release"] == 0


def test_a_pooled_run_equals_an_unpooled_one_with_16_bit_storage() -> None:
    run = Run(
        stage=3,
        steps=4,
        branch="some_ranks",
        max_norm=1.0,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, compute_dtype=torch.float32),
    )
    pooled = run_ranks(_train, 2, run, True)
    unpooled = run_ranks(_train, 2, run, False)
    for (losses, state, counts), (plain_losses, plain_state, _) in zip(
        pooled, unpooled, strict=True
    ):
        assert counts["reused"] > 0
        assert losses == plain_losses
        assert max_abs_diff(state, plain_state) == 0.0
