"""The step's one loop over chunks (see [Note: the disk tier in the step] in
engine/step_loop.py and [Note: tiers] in chunk/tiers.py), on one process with chunks that
record what the loop asks of them: every tier in the same pipeline (the next side fetched
before the current chunk steps, the one before sent back behind it), fallible tiers first and
committed only once every rank agreed, a side in memory fetched and sent back as nothing; a
failed fetch rolls the fallible tiers back before any other chunk steps."""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise.chunk.tiers import IN_MEMORY, SideTier
from shardwise.comm import CommStats
from shardwise.engine.step_loop import step_chunks
from shardwise.memory.disk_pool import DiskTierError


def _done(error: Exception | None = None) -> Future[None]:
    future: Future[None] = Future()
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
    return future


class RecordingTier(SideTier):
    fallible = True

    def __init__(self, log: list[str], chunk_id: int, fail_fetch: bool = False) -> None:
        self.log, self.chunk_id, self.fail_fetch = log, chunk_id, fail_fetch

    def fetch(self) -> Future[None]:
        self.log.append(f"fetch {self.chunk_id}")
        return _done(OSError("disk gone") if self.fail_fetch else None)

    def evict(self) -> Future[None]:
        self.log.append(f"evict {self.chunk_id}")
        return _done()

    def commit(self) -> None:
        self.log.append(f"commit {self.chunk_id}")

    def rollback(self) -> None:
        self.log.append(f"rollback {self.chunk_id}")

    def drop(self) -> None:
        self.log.append(f"drop {self.chunk_id}")


class FakeChunk:
    """What the loop uses of a chunk."""

    def __init__(self, log: list[str], chunk_id: int, tier: SideTier) -> None:
        self.log, self.chunk_id, self.tier = log, chunk_id, tier
        self.device = torch.device("cpu")  # where the agreement's all-reduce travels
        self.optim_side_resident = tier is IN_MEMORY
        chunk = self

        class Payload:
            def publish_unchanged(self) -> None:
                log.append(f"unchanged {chunk.chunk_id}")

        class Grads:
            def end_step(self) -> None:
                pass

        class Placement:
            disk = None

        self.payload, self.grads, self.placement = Payload(), Grads(), Placement()

    def publish_master(self, *, wait: bool) -> None:
        self.log.append(f"publish {self.chunk_id}")


@pytest.fixture(scope="module")
def group() -> Any:
    """A process group of this process alone (the loop's agreement is a collective)."""
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=0, world_size=1
        )
        try:
            yield None
        finally:
            dist.destroy_process_group()


def _chunks(log: list[str], tiers: list[str], failing: int | None = None) -> list[Any]:
    return [
        FakeChunk(
            log,
            i,
            IN_MEMORY if kind == "memory" else RecordingTier(log, i, fail_fetch=i == failing),
        )
        for i, kind in enumerate(tiers)
    ]


def _step(log: list[str]) -> Any:
    return lambda chunk: log.append(f"step {chunk.chunk_id}")


def test_every_tier_in_one_pipeline_fallible_ones_first_and_agreed(group: Any) -> None:
    log: list[str] = []
    chunks = _chunks(log, ["memory", "disk", "memory", "disk", "disk"])
    step_chunks(chunks, _step(log), wait_publish=True, stats=CommStats(), group=None)
    disk = [
        "fetch 1", "fetch 3", "step 1", "publish 1", "evict 1",
        "fetch 4", "step 3", "publish 3", "evict 3",
        "step 4", "publish 4", "evict 4",
        "commit 1", "commit 3", "commit 4",
    ]  # fmt: skip
    memory = ["step 0", "publish 0", "step 2", "publish 2"]
    assert log == disk + memory


def test_a_failed_fetch_rolls_the_disk_tier_back_before_memory_chunks_step(group: Any) -> None:
    log: list[str] = []
    chunks = _chunks(log, ["memory", "disk", "disk"], failing=2)
    with pytest.raises(DiskTierError, match="reading chunk 2"):
        step_chunks(chunks, _step(log), wait_publish=True, stats=CommStats(), group=None)
    assert "step 0" not in log and "step 2" not in log
    assert "rollback 1" in log and "rollback 2" in log and "commit 1" not in log
    assert "unchanged 2" in log  # its collectives issued all the same
    assert torch.distributed.is_initialized()
