"""Stage 3 keeps only a few chunks gathered at a time, and gathers each chunk once per pass."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from helpers import CONFIG, batch_slice

from shardwise import CommOp, zero_model_wrapper, zero_optim_wrapper
from shardwise.chunk import ChunkState
from shardwise.runtime import grad_reducer
from shardwise.testing import GPT, run_ranks


def _gathered_during_forward(prefetch: bool) -> dict[str, object]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": 1500, "prefetch": prefetch}
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    chunks = wrapped.chunk_manager.chunks
    peaks: list[int] = []

    def count(*_: object) -> None:
        peaks.append(sum(c.payload.state is ChunkState.GATHERED for c in chunks))

    for block in model.blocks:
        block.register_forward_hook(count)
    gathers = []
    for step in range(3):
        peaks.clear()
        wrapped.comm_stats.reset()
        optimizer.zero_grad()
        _, loss = wrapped(*batch_slice(step, 0, rank, 2))
        after_forward = sum(c.payload.state is ChunkState.GATHERED for c in chunks)
        optimizer.backward(loss)
        optimizer.step()
        gathers.append(wrapped.comm_stats.calls(CommOp.ALL_GATHER))
    return {
        "chunks": len(chunks),
        "peak_last_step": max(peaks),
        "after_forward": after_forward,
        "after_step": sum(c.payload.state is ChunkState.GATHERED for c in chunks),
        "gathers": gathers,
    }


def test_chunks_are_released_after_last_use_in_forward() -> None:
    for prefetch in (True, False):
        result = run_ranks(_gathered_during_forward, 2, prefetch)[0]
        chunks = result["chunks"]
        assert isinstance(chunks, int) and chunks >= 8
        # The tied embedding's chunk stays (the head uses it last), plus the block running
        # and the one prefetched: far from the whole model.
        assert result["peak_last_step"] <= 4, result
        # With prefetching, the chunk backward starts with (the head's, tied to the
        # embedding) stays gathered from the end of forward, and is not gathered again.
        kept = 1 if prefetch else 0
        assert result["after_forward"] == kept, result
        assert result["after_step"] == 0
        # Once the order is recorded, every chunk is gathered once in forward and once in
        # backward; the first pass may gather a tied weight's chunk again when it is reused.
        gathers = result["gathers"]
        assert isinstance(gathers, list)
        assert gathers[1:] == [2 * chunks - kept] * 2, result
        assert 2 * chunks <= gathers[0] <= 2 * chunks + 2


def _stale_copy_after_forward_without_backward(extra_forward: bool) -> list[float]:
    """Train a step, then (optionally) run a forward with gradients on and no backward, which
    leaves the chunk backward would start with gathered; step again on the same gradients
    and load a state dict, then evaluate. Each later change to the shards must reach the
    next forward."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": 1500}
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for step in range(2):
        optimizer.zero_grad()
        _, loss = wrapped(*batch_slice(step, 0, rank, 2))
        optimizer.backward(loss)
        optimizer.step()
    if extra_forward:
        wrapped(*batch_slice(5, 0, rank, 2))
        assert any(c.payload.state is ChunkState.GATHERED for c in wrapped.chunk_manager.chunks)
    optimizer.step()  # again, on the gradients already there
    with torch.no_grad():
        losses.append(float(wrapped(*batch_slice(6, 0, rank, 2))[1]))
    if extra_forward:
        wrapped(*batch_slice(5, 0, rank, 2))
    wrapped.load_state_dict(initial)
    with torch.no_grad():
        losses.append(float(wrapped(*batch_slice(6, 0, rank, 2))[1]))
        assert not any(c.payload.state is ChunkState.GATHERED for c in wrapped.chunk_manager.chunks)
    return losses


def test_a_chunk_kept_for_backward_never_serves_stale_values() -> None:
    plain = run_ranks(_stale_copy_after_forward_without_backward, 2, False)
    with_extra_forward = run_ranks(_stale_copy_after_forward_without_backward, 2, True)
    assert with_extra_forward == plain
    assert plain[0][0] != plain[0][1]  # the step and the load really changed the weights


def _reductions_in_flight(placement: str) -> list[str]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    config = {
        "device": torch.device("cpu"),
        "chunk_size_numel": 1500,
        "placement_policy": placement,
    }
    if placement == "auto":
        config["device_budget_bytes"] = 10**9
    wrapped = zero_model_wrapper(model, 3, config)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    events: list[str] = []
    # Every reduction goes through start_reduction and PendingReduction.wait (see [Note: one
    # reduction entry point]): record when each is launched and when it is waited for.
    start = grad_reducer.start_reduction

    def started(chunks: Any, **kwargs: Any) -> Any:
        ids = " ".join(str(chunk.chunk_id) for chunk in chunks)
        events.append(f"start {ids}")
        pending = start(chunks, **kwargs)
        wait = pending.wait

        def waited(*, keep_full: bool) -> Any:
            events.append(f"finish {ids}")
            return wait(keep_full=keep_full)

        pending.wait = waited
        return pending

    grad_reducer.start_reduction = started  # this rank's process only
    for chunk in wrapped.chunk_manager.chunks:
        for info in chunk.tensors:
            # Backward computing (after the engine's own hook on the same gradient), on the
            # parameter autograd accumulates into (see [Note: two faces of a stage-3
            # parameter] in chunk/parameters.py).
            info.compute.register_post_accumulate_grad_hook(lambda _: events.append("gradient"))
    for step in range(2):
        events.clear()
        optimizer.zero_grad()
        _, loss = wrapped(*batch_slice(step, 0, rank, 2))
        optimizer.backward(loss)
        optimizer.step()
    return events


def test_stage3_reductions_run_behind_backward_one_at_a_time() -> None:
    # "auto" overlaps its reductions too, counted inside its budget (ample here).
    for placement in ("cuda", "auto"):
        events = run_ranks(_reductions_in_flight, 2, placement)[0]
        in_flight, most, behind = 0, 0, 0
        for event in events:
            if event == "gradient":
                behind += in_flight  # backward computes while a reduction runs
                continue
            in_flight += 1 if event.startswith("start") else -1
            most = max(most, in_flight)
        # One at a time (see [Note: gradients in flight]), and not waited for at once.
        assert in_flight == 0 and most == 1, events
        reductions = sum(event.startswith("start") for event in events)
        assert behind >= reductions - 1, events


def test_prefetch_looks_past_module_calls_over_chunks_already_there() -> None:
    from shardwise.runtime.pass_trace import PassTrace

    trace = PassTrace(depth=1)
    trace.begin()
    for chunk_ids in [(0,), (1,), (1,), (1, 2), (2,), (0,)]:
        trace.visit(chunk_ids)
    trace.finish()
    trace.begin()
    upcoming = []
    for chunk_ids in [(0,), (1,), (1,), (1, 2), (2,), (0,)]:
        trace.visit(chunk_ids)
        upcoming.append(trace.upcoming())
    # From the first call over chunk 1 on, chunk 2 is next; nothing is after the last call.
    assert upcoming == [(1,), (2,), (2,), (0,), (0,), ()]
    trace.begin()
    trace.visit((0,))
    trace.visit((3,))  # off the record: no more prefetching this pass
    assert trace.upcoming() == ()


def test_a_deeper_prefetch_takes_the_next_chunks_in_order_of_first_use() -> None:
    # ColossalAI's max_prefetch=n: the next n chunks the recorded pass needs, whole calls at a
    # time (a call needing two new chunks brings both).
    from shardwise.runtime.pass_trace import PassTrace

    calls = [(0,), (1,), (1,), (2, 3), (4,), (5,)]
    trace = PassTrace(depth=3)
    trace.begin()
    for chunk_ids in calls:
        trace.visit(chunk_ids)
    trace.finish()
    trace.begin()
    upcoming = []
    for chunk_ids in calls:
        trace.visit(chunk_ids)
        upcoming.append(trace.upcoming())
    assert upcoming == [(1, 2, 3), (2, 3, 4), (2, 3, 4), (4, 5), (5,), ()]


def _in_flight_during_forward(max_prefetch: int) -> dict[str, Any]:
    """Stage 3 through the Gemini arguments: the most chunks gathered or being gathered at
    once while the blocks run, and the losses."""
    from shardwise.zero import GeminiDDP

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    wrapped = GeminiDDP(
        model, chunk_config_dict={2: {"chunk_size": 1500}}, placement_policy="cuda",
        mixed_precision=torch.float32, max_prefetch=max_prefetch,
    )  # fmt: skip
    optimizer = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    chunks = wrapped.chunk_manager.chunks
    peaks: list[int] = []

    def count(*_: object) -> None:
        peaks.append(
            sum(c.payload.state is ChunkState.GATHERED or c.payload.gather_pending for c in chunks)
        )

    for block in model.blocks:
        block.register_forward_pre_hook(count)
    losses = []
    for step in range(3):
        peaks.clear()
        optimizer.zero_grad()
        _, loss = wrapped(*batch_slice(step, 0, rank, 2))
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"peak": max(peaks), "losses": losses}


def test_max_prefetch_gathers_that_many_chunks_ahead_with_the_same_losses() -> None:
    seen = {n: run_ranks(_in_flight_during_forward, 2, n)[0] for n in (0, 1, 3)}
    assert seen[0]["losses"] == seen[1]["losses"] == seen[3]["losses"], seen
    # A block's own chunk and the tied embedding's, then 0, 1 or 3 more ahead of it.
    assert seen[0]["peak"] < seen[1]["peak"] < seen[3]["peak"], seen
    assert seen[3]["peak"] - seen[1]["peak"] >= 2, seen


def _release_during_prefetch() -> bool:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": 1500}
    )
    chunk = wrapped.chunk_manager.chunks[1]
    chunk.payload.start_gather()
    assert chunk.payload.gather_pending
    chunk.payload.release()  # waits for the running all-gather, then frees its buffer
    assert not chunk.payload.gather_pending and chunk.payload.state is ChunkState.SHARDED
    assert chunk.payload.full.untyped_storage().size() == 0
    chunk.payload.gather()
    return all(torch.equal(info.compute, expected[info.name]) for info in chunk.tensors)


def test_releasing_a_chunk_whose_prefetch_is_running_waits_for_it() -> None:
    assert run_ranks(_release_during_prefetch, 2) == [True, True]


def _no_sync_passes() -> dict[str, Any]:
    """Two micro-batches under no_sync, then one outside, at stage 3."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": 1500}
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    chunks = wrapped.chunk_manager.chunks
    stats = wrapped.comm_stats
    peak_gathered = 0

    def count(*_: object) -> None:
        nonlocal peak_gathered
        peak_gathered = max(
            peak_gathered, sum(c.payload.state is ChunkState.GATHERED for c in chunks)
        )

    for block in model.blocks:
        block.register_full_backward_hook(count)
    result: dict[str, Any] = {}
    optimizer.zero_grad()
    reductions = (CommOp.REDUCE_SCATTER, CommOp.ALL_REDUCE)
    for micro in range(3):
        before = {op: stats.calls(op) for op in reductions}
        _, loss = wrapped(*batch_slice(0, micro, rank, 2))
        if micro < 2:
            with wrapped.no_sync():
                optimizer.backward(loss)
            result[f"reductions_{micro}"] = sum(stats.calls(op) - before[op] for op in reductions)
            result[f"grad_bytes_{micro}"] = wrapped.memory_report()["grads"]
            result[f"gathered_after_{micro}"] = sum(
                c.payload.state is ChunkState.GATHERED for c in chunks
            )
        else:
            optimizer.backward(loss)
            result["grad_bytes_after_sync"] = wrapped.memory_report()["grads"]
    trainable = [c for c in chunks if c.requires_grad]
    result["unsharded_grad_bytes"] = sum(c.padded_numel * 4 for c in trainable)
    result["shard_grad_bytes"] = sum(c.shard_numel * 4 for c in trainable)
    result["peak_gathered"] = peak_gathered
    result["chunks"] = len(chunks)
    return result


def test_no_sync_at_stage_3_reduces_nothing_and_releases_chunks_as_it_goes() -> None:
    result = run_ranks(_no_sync_passes, 2)[0]
    # Inside no_sync: no gradient reduction; what remains are the pass checks of [Note: ranks
    # in step], all-reduces of a few numbers, one at the forward and one at the backward.
    assert result["reductions_0"] == 2 and result["reductions_1"] == 2, result
    # Whole gradients are kept (the documented cost); the fp32 gradient shards are not there
    # yet, as their first reduction allocates them ([Note: the gradient shard is allocated
    # when first written]). Parameters are not kept: every chunk is released once its
    # gradients are in, as in a synchronised pass.
    kept = result["unsharded_grad_bytes"]
    assert result["grad_bytes_0"] == result["grad_bytes_1"] == kept, result
    assert result["gathered_after_0"] == result["gathered_after_1"] == 0
    assert result["peak_gathered"] < result["chunks"]
    # The synchronised backward reduces the sum and keeps only this rank's shard.
    assert result["grad_bytes_after_sync"] == result["shard_grad_bytes"], result
