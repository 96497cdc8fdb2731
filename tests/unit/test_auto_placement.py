"""The "auto" policy's eviction order, on one process."""

from __future__ import annotations

import torch
from torch import nn

from shardwise import ChunkManager
from shardwise.chunk import Pool
from shardwise.gemini import Pass
from shardwise.gemini.auto_placement import AutoPlacer
from shardwise.gemini.tracer import MemoryTracer


def _placer() -> tuple[AutoPlacer, ChunkManager]:
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(4)))
    manager = ChunkManager(chunk_size_numel=16, device=torch.device("cpu"))
    manager.register(model.named_parameters())
    placer = AutoPlacer(
        manager,
        budget=10**9,
        margin_ratio=0.0,
        device_bytes=lambda: 0,
        chunk_device_bytes=lambda chunk: 0,
        tracer=MemoryTracer(torch.device("cpu"), lambda: 0),
        evict_optim=lambda chunk: None,
    )
    return placer, manager


def test_farthest_next_use_is_evicted_first_and_unused_before_all() -> None:
    placer, manager = _placer()
    assert len(manager.chunks) == 4
    # One step uses chunks 0, 1, 2 in forward and 2, 1, 0 in backward; chunk 3 never.
    for ids in [(0,), (1,), (2,), (2,), (1,), (0,)]:
        placer.before_gather([manager.chunks[i] for i in ids], Pass.FORWARD)
    placer.end_warmup(move_optim=lambda chunk: None)
    # At position 1 (chunk 1 in use): never-used chunk 3 goes first; then chunk 0, whose next
    # use (position 5) is farther than chunk 2's (position 2).
    order = []
    for _ in range(3):
        victim = placer._victim({1}, 1)
        assert victim is not None
        order.append(victim.chunk_id)
        victim.move_payload(Pool.HOST)
    assert order == [3, 0, 2]
    assert placer._victim({1}, 1) is None


def test_warmup_evicts_least_recently_used() -> None:
    placer, manager = _placer()
    for ids in [(2,), (0,), (1,)]:
        placer.before_gather([manager.chunks[i] for i in ids], Pass.FORWARD)
    victim = placer._victim({1}, 3)
    assert victim is not None and victim.chunk_id == 3  # never used at all
    victim.move_payload(Pool.HOST)
    victim = placer._victim({1}, 3)
    assert victim is not None and victim.chunk_id == 2
