"""Where a chunk's optimizer side lives between steps, and how a step brings it in and back.

[Note: tiers]
A chunk's optimizer side (fp32 master, optimizer state; its gradient shard stays in memory)
lives in a tier: device or host memory (`InMemory`), or the disk tier's files (`OnDisk`, see
[Note: the disk tier] in memory/disk_pool.py). The step treats every tier alike, one chunk at
a time in one pipelined loop (engine/step_loop.py): `fetch()` brings the side in (started one
chunk ahead), the chunk steps, `evict()` sends it back (finished one chunk behind); once every
rank has stepped, `commit()` makes what was sent back the tier's current copy, or, where a
tier that can fail (`fallible`) failed on some rank, `rollback()` forgets it and the step is
undone from the copy before. A tier in memory has nothing to fetch, send back or undo: its
futures are done when made. A new tier is one class here.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import ClassVar

import torch

from shardwise.memory.disk_pool import DiskPool


class SideTier:
    """The tier of one chunk's optimizer side (see [Note: tiers])."""

    # Whether fetches and evictions can fail (so a step agrees on every rank before it is
    # kept, and can be rolled back).
    fallible: ClassVar[bool] = False

    def fetch(self) -> Future[None]:
        """Start bringing the side into memory, as the last `commit` left it."""
        return _done()

    def evict(self) -> Future[None]:
        """Start sending the side back after its step (kept apart until `commit`)."""
        return _done()

    def commit(self) -> None:
        """What `evict` sent back is now the current copy."""

    def rollback(self) -> None:
        """Forget what `evict` sent back since the last `commit`."""

    def drop(self) -> None:
        """Free what `fetch` brought in, the current copy left as it is."""


class InMemory(SideTier):
    """Device or host memory: the side is always there."""


IN_MEMORY = InMemory()


class OnDisk(SideTier):
    """The disk tier: the side's bytes in the pool's files, in memory only from a fetch to
    the next eviction (their storage resized to zero between, the tensors kept).

    Args:
        pool: the disk tier's files.
        key: this chunk's files in it.
        side: the tensors the tier holds (the master and the optimizer state), asked for at
            each eviction (the optimizer may have made state since).
        count: counts the bytes moved, in (True) and out (False).
    """

    fallible: ClassVar[bool] = True

    def __init__(
        self,
        pool: DiskPool,
        key: int,
        side: Callable[[], list[torch.Tensor]],
        count: Callable[[int, bool], None],
    ) -> None:
        self.pool = pool
        self._key = key
        self._side = side
        self._count = count
        # The tensors whose bytes the current copy holds, and those of the copy written since
        # (until committed or rolled back).
        self._written: list[torch.Tensor] = []
        self._writing: list[torch.Tensor] = []

    def fetch(self) -> Future[None]:
        """Read the current copy back into the tensors that were written (the state the
        optimizer had then)."""
        self._count(sum(_nbytes(t) for t in self._written), True)
        return self.pool.read(self._key, self._written)

    def evict(self) -> Future[None]:
        """Write the side to the next copy, its memory freed once written."""
        tensors = self._side()
        for tensor in tensors:
            # Freeing a storage must free this tensor's elements and nobody else's (the
            # optimizer's views of the master share them, and follow when they come back).
            if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != _nbytes(tensor):
                raise RuntimeError(
                    f"chunk {self._key}: a tensor of its optimizer side is part of a larger "
                    f"storage ({tuple(tensor.shape)}), so the disk tier cannot free it"
                )
        self._count(sum(_nbytes(t) for t in tensors), False)
        self._writing = tensors
        return self.pool.write(self._key, tensors)

    def commit(self) -> None:
        self.pool.commit([self._key])
        self._written, self._writing = self._writing, []

    def rollback(self) -> None:
        self.pool.discard([self._key])
        self._writing = []

    def drop(self) -> None:
        for tensor in self._written:
            tensor.untyped_storage().resize_(0)

    def leave(self) -> None:
        """The side leaves the disk tier (read back into memory first): its files go."""
        self.pool.forget(self._key)
        self._written = []


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


__all__ = ["IN_MEMORY", "InMemory", "OnDisk", "SideTier"]
