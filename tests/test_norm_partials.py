"""The step's gradient norm from shares taken as each reduction is accepted (see [Note: norm
partials] in chunk/grads.py), on 2 ranks: after a synchronised backward every chunk of stages
2 and 3 holds its share, and the norm the step computes from the shares is, bit for bit, the
norm read from the shards; a second backward added into the shards drops the shares, and the
step reads the shards then (the accumulated gradient's norm, not the last pass's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, adamw, batch_slice, make_model

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.engine.grad_norm import global_grad_norm
from shardwise.testing import run_ranks


def _norms(stage: int, passes: int) -> tuple[list[bool], float, float]:
    rank = dist.get_rank()
    model = make_model()
    config: dict[str, Any] = {"device": torch.device("cpu")}
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        adamw(model.parameters()),
        max_norm=1e9,  # clipping on: the step needs the norm first
        optim_config={"reduce_bucket_size": CHUNK_NUMEL} if stage < 3 else None,
    )
    optimizer.zero_grad()
    for micro in range(passes):
        optimizer.backward(wrapped(*batch_slice(0, micro, rank, 2)))
    chunks = list(wrapped.chunk_manager.trainable_chunks())
    held = [chunk.grads.norm_partial is not None for chunk in chunks]
    from_shards = global_grad_norm(
        [chunk.grads.for_step() for chunk in chunks],
        2.0,
        wrapped.comm_stats,
        None,
        torch.device("cpu"),
    ).norm
    optimizer.step()
    return held, from_shards, optimizer.last_grad_norm


@pytest.mark.parametrize("stage", [2, 3])
def test_the_step_norm_from_shares_is_the_norm_of_the_shards(stage: int) -> None:
    for held, from_shards, stepped in run_ranks(_norms, 2, stage, 1):
        assert held and all(held)
        assert stepped == from_shards > 0  # loss scale 1: the norm as computed


@pytest.mark.parametrize("stage", [2, 3])
def test_an_accumulated_gradient_drops_the_shares_and_reads_the_shards(stage: int) -> None:
    for held, from_shards, stepped in run_ranks(_norms, 2, stage, 2):
        assert not any(held)
        assert stepped == from_shards > 0
