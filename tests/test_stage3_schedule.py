"""Stage 3 keeps only a few chunks gathered at a time, and gathers each chunk once per pass."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import CONFIG, batch_slice

from shardwise import CommOp, zero_model_wrapper, zero_optim_wrapper
from shardwise.chunk import ChunkState
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
        peaks.append(sum(c.state is ChunkState.GATHERED for c in chunks))

    for block in model.blocks:
        block.register_forward_hook(count)
    gathers = []
    for step in range(3):
        peaks.clear()
        wrapped.comm_stats.reset()
        optimizer.zero_grad()
        _, loss = wrapped(*batch_slice(step, 0, rank, 2))
        after_forward = sum(c.state is ChunkState.GATHERED for c in chunks)
        optimizer.backward(loss)
        optimizer.step()
        gathers.append(wrapped.comm_stats.calls(CommOp.ALL_GATHER))
    return {
        "chunks": len(chunks),
        "peak_last_step": max(peaks),
        "after_forward": after_forward,
        "after_step": sum(c.state is ChunkState.GATHERED for c in chunks),
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
        assert result["after_forward"] == 0
        assert result["after_step"] == 0
        # Once the order is recorded, every chunk is gathered once in forward and once in
        # backward; the first pass may gather a tied weight's chunk again when it is reused.
        gathers = result["gathers"]
        assert isinstance(gathers, list)
        assert gathers[1:] == [2 * chunks] * 2
        assert 2 * chunks <= gathers[0] <= 2 * chunks + 2
