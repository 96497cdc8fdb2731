"""Progress of a long save or load, logged as torch.distributed.checkpoint writes and reads
each tensor.

A big model's sharded save or load takes minutes in one call (`dcp.save`, `dcp.load`) that
says nothing until it returns. Its planners see every tensor as it goes: the save planner
hands each one to the writer (`resolve_data`), the load planner receives each one read
(`commit_tensor`). These planners are torch's defaults, counting: at each tenth of this rank's
bytes, and at the end, the `shardwise.checkpoint` logger says how far the rank is, at INFO; and
rank 0 draws a progress bar of its bytes where one is wanted (see [Note: when the bar shows] in
logging/progress_bar.py), which the caller decides before the first collective.
"""

from __future__ import annotations

import io
import logging
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem

from shardwise.logging.progress_bar import progress_bar

_log = logging.getLogger("shardwise.checkpoint")


class _Tally:
    """Bytes done out of `total`, logged at each tenth and at the end, and drawn on a bar
    where `bar` is (closed when all are done)."""

    def __init__(self, verb: str, total: int, *, description: str, bar: bool) -> None:
        self.verb, self.total, self.done = verb, total, 0
        self._next = total / 10
        self._started = time.perf_counter()
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._bar = progress_bar(total, description, shown=bar)
        if total == 0:
            self._bar.close()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        self._bar.update(nbytes)
        if self.done >= self.total:
            self._bar.close()
        if self.done >= self._next or self.done >= self.total:
            while self._next <= self.done:
                self._next += self.total / 10 or 1
            _log.info(
                "rank %d: %s %s of %s (%d%%, %.1f s)",
                self._rank, self.verb, _size(self.done), _size(self.total),
                100 * self.done // max(self.total, 1), time.perf_counter() - self._started,
            )  # fmt: skip


class ProgressSavePlanner(DefaultSavePlanner):
    """torch's default save planner, logging this rank's progress (see the module note) and
    drawing it on a bar where `bar` (the caller's `progress_wanted()`)."""

    def __init__(self, *, bar: bool = False) -> None:
        super().__init__()
        self._bar = bar

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        total = sum(_written_bytes(item) for item in plan.items)
        self._tally = _Tally("saved", total, description="checkpoint save", bar=self._bar)
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and hasattr(self, "_tally"):
            self._tally.add(data.numel() * data.element_size())
        return data


class ProgressLoadPlanner(DefaultLoadPlanner):
    """torch's default load planner, logging this rank's progress (see the module note) and
    drawing it on a bar where `bar` (the caller's `progress_wanted()`)."""

    def __init__(self, *, bar: bool = False) -> None:
        super().__init__()
        self._bar = bar

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        total = sum(self._read_bytes(item) for item in plan.items)
        self._tally = _Tally("read", total, description="checkpoint load", bar=self._bar)
        return plan

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if hasattr(self, "_tally"):
            self._tally.add(tensor.numel() * tensor.element_size())

    def _read_bytes(self, item: ReadItem) -> int:
        if item.type.name == "BYTE_IO":
            return 0
        return math.prod(item.lengths) * self.lookup_tensor(item.dest_index).element_size()


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _written_bytes(item: WriteItem) -> int:
    data = item.tensor_data
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * torch.empty((), dtype=data.properties.dtype).element_size()
