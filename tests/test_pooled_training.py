"""Training with the pool of host buffers (see [Note: a pool of host buffers] in
memory/buffer_pool.py) on 2 ranks, every buffer the pool hands out, reused or new, filled with
NaN first, so that a read of one before it is written would reach the losses and weights; with
clipping, which reads every element of the gradient shards, and at stage 2 a branch the second
rank skips (stage 3 refuses a branch some ranks skip outside its gather units, so it runs the
branch always). Against the plain torch loop at stages 2 and 3 within tests/test_parity.py's
clipping tolerances (the global norm is summed in another order than clip_grad_norm_ does); a
pooled run against an unpooled one with 16-bit storage, bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, Run, adamw, batch_slice, make_model, max_abs_diff, reference

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.memory.buffer_pool import BufferPool, pool_supported
from shardwise.testing import run_ranks

pytestmark = pytest.mark.skipif(not pool_supported(), reason="this torch cannot move memory")

# Stage 2: buckets that mix the branch with parameters every rank's gradient reaches. Stage 3:
# chunks many and alike (tests/helpers.py's), so that released ones serve the next.
CHUNK_NUMEL = {2: 8191, 3: CHUNK_NUMEL}
# tests/test_parity.py's, for clipping.
PARAM_TOL = 1e-4
LOSS_TOL = 1e-5


def _nan(storage: torch.UntypedStorage) -> None:
    torch.tensor([], dtype=torch.uint8).set_(storage).fill_(0xFF)  # NaN in fp32 and bf16


def _poison_what_it_hands_out(pool: BufferPool) -> None:
    fill, empty = pool.fill, pool.empty

    def poisoned_fill(tensor: torch.Tensor) -> None:
        fill(tensor)
        _nan(tensor.untyped_storage())

    def poisoned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = empty(numel, dtype)
        _nan(tensor.untyped_storage())
        return tensor

    pool.fill = poisoned_fill  # type: ignore[method-assign]
    pool.empty = poisoned_empty  # type: ignore[method-assign]


def _train(run: Run, pool: bool) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    rank = dist.get_rank()
    model = make_model(run.branch)
    config: dict[str, Any] = {
        "device": torch.device("cpu"),
        "mixed_precision": run.mixed_precision,
        "host_buffer_pool": pool,
    }
    if run.stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL[3]
    wrapped = zero_model_wrapper(model, run.stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        adamw(model.parameters()),
        max_norm=run.max_norm,
        optim_config={"reduce_bucket_size": CHUNK_NUMEL[2]} if run.stage < 3 else None,
    )
    buffers = wrapped.chunk_manager.buffer_pool
    if buffers is not None:
        _poison_what_it_hands_out(buffers)
    losses = []
    spare_between_steps = []
    for step in range(run.steps):
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, run.world))
        optimizer.backward(loss)
        total = loss.detach().float()
        dist.all_reduce(total)
        optimizer.step()
        losses.append(float(total / run.world))
        spare_between_steps.append(wrapped.pooled_bytes())
    counts = {
        "limit": buffers.spare_limit_bytes if buffers is not None else 0,
        "reused": buffers.reused if buffers is not None else 0,
        "spare_between_steps": spare_between_steps,
    }
    return losses, wrapped.state_dict(only_rank_0=False), counts


@pytest.mark.parametrize(("stage", "branch"), [(2, "some_ranks"), (3, "always")])
def test_a_pooled_run_equals_the_torch_loop_in_fp32(stage: int, branch: str) -> None:
    run = Run(stage=stage, steps=4, branch=branch, max_norm=1.0)
    expected_losses, expected_state = reference(run)
    for losses, state, counts in run_ranks(_train, 2, run, True):
        assert losses == pytest.approx(expected_losses, abs=LOSS_TOL)
        assert max_abs_diff(state, expected_state) < PARAM_TOL
        if stage == 3:  # released payloads serve the next gathers and gradients
            assert counts["reused"] > 0
        # Between steps the pool holds at most its limit.
        assert max(counts["spare_between_steps"]) <= counts["limit"]


def test_a_pooled_run_equals_an_unpooled_one_with_16_bit_storage() -> None:
    run = Run(
        stage=3,
        steps=4,
        branch="always",
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
