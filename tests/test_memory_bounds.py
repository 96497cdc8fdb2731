"""What the engine holds, counted: gradients in flight within the bucket promise, an fp32
parameter held once, a stage-1/2 model packed once.

benchmarks/bench_memory.py measures the same from outside (resident sets) at 100M+ parameters;
these tests pin the mechanisms on a small model, by counted bytes and storage identity.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, CONFIG, batch_slice

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.chunk import Chunk
from shardwise.chunk.accounting import storage_bytes
from shardwise.chunk.grads import GradSide
from shardwise.chunk.reduction import PendingReduction
from shardwise.testing import GPT, run_ranks


def _grad_bytes_in_flight(stage: int, slow_network: bool) -> dict[str, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    config: dict[str, Any] = {"device": torch.device("cpu")}
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.SGD(model.parameters(), lr=0.1),
        optim_config={"reduce_bucket_size": CHUNK_NUMEL} if stage < 3 else None,
    )
    chunks = wrapped.chunk_manager.chunks
    most = 0
    add_grad, wait = GradSide.add, PendingReduction.wait

    def counting_add_grad(grads: GradSide, index: int, grad: torch.Tensor) -> bool:
        nonlocal most
        complete = add_grad(grads, index, grad)
        most = max(most, sum(storage_bytes(c.grads.full) for c in chunks))
        return complete

    def slow_wait(pending: PendingReduction, *, keep_full: bool) -> list[Chunk]:
        time.sleep(0.02)  # a network far slower than this model's backward
        return wait(pending, keep_full=keep_full)

    GradSide.add = counting_add_grad  # type: ignore[method-assign]  # this rank's process only
    if slow_network:
        PendingReduction.wait = slow_wait  # type: ignore[method-assign]
    for step in range(2):
        optimizer.zero_grad()
        _, loss = wrapped(*batch_slice(step, 0, rank, world))
        optimizer.backward(loss)
        left = sum(storage_bytes(c.grads.full) for c in chunks)
        optimizer.step()
    return {
        "most": most,
        "left_after_backward": left,
        "bucket": max(c.padded_numel for c in chunks) * 4,
        "model": sum(c.padded_numel for c in chunks) * 4,
    }


@pytest.mark.parametrize("slow_network", [False, True], ids=["fast", "slow"])
@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_in_flight_stay_within_a_bucket_filling_and_one_reducing(
    stage: int, slow_network: bool
) -> None:
    result = run_ranks(_grad_bytes_in_flight, 2, stage, slow_network)[0]
    assert result["model"] >= 6 * result["bucket"]  # waiting for all at the end would show
    # One bucket filling while one reduces, and one more complete in between: never the model.
    assert result["most"] <= 3 * result["bucket"], result
    assert result["left_after_backward"] == 0


def _storage_of_fp32_state(stage: int, placement: str) -> list[str]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    config: dict[str, Any] = {"device": torch.device("cpu")}
    if stage == 3:
        config.update(chunk_size_numel=CHUNK_NUMEL, placement_policy=placement)
        if placement == "static":
            config.update(offload_optim_frac=1.0, offload_param_frac=1.0)
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3))
    problems = []
    for chunk in wrapped.chunk_manager.trainable_chunks():
        shard = chunk.payload.shard.untyped_storage()
        if chunk.master is not chunk.payload.shard:
            problems.append(f"chunk {chunk.chunk_id}: a master copy beside the fp32 shard")
        if stage < 3 and shard.data_ptr() != chunk.payload.full.untyped_storage().data_ptr():
            problems.append(f"chunk {chunk.chunk_id}: the shard is not a slice of the payload")
        if stage < 3:
            for info in chunk.tensors:
                if info.param.untyped_storage().data_ptr() != shard.data_ptr():
                    problems.append(f"{info.name} does not view its chunk's payload")
    for name, view in optimizer.shard_views.items():
        chunk, _ = wrapped.chunk_manager.locate(dict(model.named_parameters())[name])
        if view.untyped_storage().data_ptr() != chunk.payload.shard.untyped_storage().data_ptr():
            problems.append(f"the optimizer steps a copy of {name}")
    return problems


@pytest.mark.parametrize(
    ("stage", "placement"), [(1, ""), (2, ""), (3, "cuda"), (3, "cpu"), (3, "static")]
)
def test_an_fp32_parameter_is_held_once(stage: int, placement: str) -> None:
    assert run_ranks(_storage_of_fp32_state, 2, stage, placement) == [[], []]


def _chunks_closed(reduce_bucket_size: int, forward_first: bool) -> dict[str, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    closed = 0
    close = Chunk.close

    def counting_close(chunk: Chunk, src_rank: int | None = 0) -> None:
        nonlocal closed
        closed += 1
        close(chunk, src_rank)

    Chunk.close = counting_close  # type: ignore[method-assign]  # this rank's process only
    torch.manual_seed(0)
    model = GPT(CONFIG)
    wrapped = zero_model_wrapper(model, 2, {"device": torch.device("cpu")})
    if forward_first:
        wrapped(*batch_slice(0, 0, rank, world))
    zero_optim_wrapper(
        wrapped,
        torch.optim.SGD(model.parameters(), lr=0.1),
        optim_config={"reduce_bucket_size": reduce_bucket_size},
    )
    manager = wrapped.chunk_manager
    return {"closed": closed, "chunks": len(manager.chunks), "size": manager.chunk_size_numel}


def test_a_stage_2_model_is_packed_once_with_the_optimizers_bucket_size() -> None:
    result = run_ranks(_chunks_closed, 2, CHUNK_NUMEL, False)[0]
    assert result == {"closed": result["chunks"], "chunks": result["chunks"], "size": CHUNK_NUMEL}
    assert result["chunks"] > 2
    # Used before its optimizer was wrapped: packed with the default, then re-packed.
    used = run_ranks(_chunks_closed, 2, CHUNK_NUMEL, True)[0]
    assert used["size"] == CHUNK_NUMEL and used["closed"] > used["chunks"]
