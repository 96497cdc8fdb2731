"""Each chunk goes where its placement puts it as soon as it closes (see [Note: placed as each
chunk closes] in chunk/manager.py): the device never holds every shard and master of the
model at once, and the chunks end where a placement after packing would have put them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardwise import GeminiManager, zero_model_wrapper
from shardwise.chunk import Chunk, ChunkManager, Pool
from shardwise.chunk.accounting import resting_device_bytes
from shardwise.testing import run_ranks

CPU = torch.device("cpu")
WIDTH, DEPTH = 64, 8


def _model() -> nn.Module:
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))
    # A frozen chunk closes among the trainable ones, out of chunk order.
    model[2].requires_grad_(False)
    return model


def _pools(chunks: list[Chunk]) -> list[tuple[Pool, Pool]]:
    return [(c.placement.payload, c.placement.optim) for c in chunks]


class _DeviceWatch:
    """Records, as each chunk starts to close, the device bytes of the chunks closed before
    it (placed by then when chunks are placed as they close)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.closed: list[Chunk] = []
        self.device_bytes: list[int] = []
        close = Chunk.close

        def watched(chunk: Chunk, *args: Any, **kwargs: Any) -> None:
            self.device_bytes.append(self.now())
            close(chunk, *args, **kwargs)
            self.closed.append(chunk)

        monkeypatch.setattr(Chunk, "close", watched)

    def now(self) -> int:
        return sum(resting_device_bytes(c) for c in self.closed)


@pytest.mark.parametrize("policy", ["cpu", "auto", "static"])
def test_chunks_are_placed_as_they_close_where_placing_after_packing_puts_them(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options: dict[str, Any] = {"device_budget_bytes": 60_000} if policy == "auto" else {}
    if policy == "static":
        options = {"offload_param_frac": 0.5, "offload_optim_frac": 1.0}

    def packed(as_they_close: bool) -> ChunkManager:
        torch.manual_seed(0)
        model = _model()
        manager = ChunkManager(
            chunk_size_numel=WIDTH * WIDTH + WIDTH, device=CPU, keep_gathered=False
        )
        gemini = GeminiManager(policy, manager, **options)
        if as_they_close:
            manager.register(model.named_parameters(), placer=gemini)
        else:
            manager.register(model.named_parameters())
            gemini.place_chunks()
        return manager

    after_packing = packed(as_they_close=False)
    watch = _DeviceWatch(monkeypatch)
    as_they_close = packed(as_they_close=True)
    assert len(as_they_close.chunks) == DEPTH
    assert _pools(as_they_close.chunks) == _pools(after_packing.chunks)
    # Some chunk lives in host memory, else the test shows nothing.
    assert any(Pool.HOST in pools for pools in _pools(as_they_close.chunks))
    # At every close the device holds what the plan keeps there of the chunks closed before,
    # never the chunks it sends to host memory.
    planned = [resting_device_bytes(c) for c in after_packing.chunks]
    assert watch.device_bytes == [sum(planned[:k]) for k in range(DEPTH)]
    assert watch.closed == as_they_close.chunks


def _meta_wrap_device_peak() -> dict[str, Any]:
    """A meta-device model wrapped under "cpu" and under "auto" with a budget below its
    shards: what the device held at each close, and the values against an unsharded build."""
    import torch.distributed as dist

    results: dict[str, Any] = {}
    for policy, extra in (("cpu", {}), ("auto", {"device_budget_bytes": 80_000})):
        with pytest.MonkeyPatch.context() as monkeypatch:
            watch = _DeviceWatch(monkeypatch)
            torch.manual_seed(0)
            with torch.device("meta"):
                model = _model()
            wrapped = zero_model_wrapper(
                model,
                3,
                {
                    "device": CPU,
                    "placement_policy": policy,
                    "chunk_size_numel": WIDTH * WIDTH + WIDTH,
                    **extra,
                },
            )
            chunks = wrapped.chunk_manager.chunks
            final = [resting_device_bytes(c) for c in chunks]
            results[policy] = {
                "peak": max(watch.device_bytes),
                "whole": sum(c.shard_numel * 8 for c in chunks),
                "final": sum(final),
                "on_host": sum(c.placement.payload is Pool.HOST for c in chunks),
                "state": {k: v.clone() for k, v in wrapped.state_dict(only_rank_0=False).items()},
            }
    torch.manual_seed(0)
    results["plain"] = {k: v.clone() for k, v in _model().state_dict().items()}
    results["rank"] = dist.get_rank()
    return results


def test_a_meta_model_never_holds_its_shards_on_the_device_at_once() -> None:
    for result in run_ranks(_meta_wrap_device_peak, world_size=2):
        for policy in ("cpu", "auto"):
            figures = result[policy]
            assert figures["on_host"] > 0
            # The device peaks at what stays there, never at the whole model's shards and
            # masters (8 bytes an element in fp32, as a placement after packing held them).
            assert figures["peak"] <= figures["final"] < figures["whole"], (policy, figures)
            for name, value in result["plain"].items():
                assert torch.equal(figures["state"][name], value), (policy, name)
        assert result["cpu"]["final"] == 0
        assert result["auto"]["final"] > 0
