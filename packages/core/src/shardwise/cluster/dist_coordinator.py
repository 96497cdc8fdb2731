"""DistCoordinator: which rank does what (ColossalAI's `colossalai.cluster.DistCoordinator`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

T = TypeVar("T")


class DistCoordinator:
    """The ranks of the default process group, and helpers to run code on some of them.

    One instance per process (constructing it again returns the same object), as ColossalAI's
    singleton. Needs an initialised process group (`shardwise.launch_from_torch()` or
    `torch.distributed.init_process_group()`).
    """

    _instance: DistCoordinator | None = None

    def __new__(cls) -> DistCoordinator:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call shardwise.launch_from_torch() or "
                "torch.distributed.init_process_group() before building a DistCoordinator"
            )
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._local_rank = int(os.environ.get("LOCAL_RANK", -1))
        return cls._instance

    # Ranks are asked of torch.distributed each time rather than kept: the coordinator holds
    # no reference to a process group, so destroying the group frees it (a gloo group alive at
    # interpreter exit can abort the process, see [Note: gloo at exit] in comm/lifecycle.py),
    # and a group started again is seen.
    _local_rank: int

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (LOCAL_RANK); -1 when the launcher did not set it."""
        return self._local_rank

    def is_master(self, process_group: ProcessGroup | None = None) -> bool:
        """Whether this is rank 0 of `process_group` (None: the default group)."""
        return dist.get_rank(group=process_group) == 0

    def is_node_master(self) -> bool:
        """Whether this is local rank 0 (needs LOCAL_RANK, which torchrun sets)."""
        if self._local_rank < 0:
            raise RuntimeError("LOCAL_RANK is not set: start the script with torchrun")
        return self._local_rank == 0

    def is_last_process(self, process_group: ProcessGroup | None = None) -> bool:
        """Whether this is the last rank of `process_group`."""
        return dist.get_rank(group=process_group) == dist.get_world_size(group=process_group) - 1

    def print_on_master(self, msg: str, process_group: ProcessGroup | None = None) -> None:
        """Print `msg` on rank 0 of `process_group` only."""
        if self.is_master(process_group):
            print(msg)

    def print_on_node_master(self, msg: str) -> None:
        """Print `msg` on local rank 0 of each node only."""
        if self.is_node_master():
            print(msg)

    @contextmanager
    def priority_execution(
        self, executor_rank: int = 0, process_group: ProcessGroup | None = None
    ) -> Iterator[None]:
        """Run the body on `executor_rank` first and on the other ranks after it finished
        (e.g. one rank downloads a dataset, the others then read it from the cache)."""
        executor = dist.get_rank(group=process_group) == executor_rank
        if not executor:
            dist.barrier(group=process_group)
        yield
        if executor:
            dist.barrier(group=process_group)

    def block_all(self, process_group: ProcessGroup | None = None) -> None:
        """Wait until every rank of `process_group` reaches this call."""
        dist.barrier(group=process_group)

    def destroy(self, process_group: ProcessGroup | None = None) -> None:
        """Destroy `process_group` (None: the default group)."""
        dist.destroy_process_group(process_group)

    def on_master_only(
        self, process_group: ProcessGroup | None = None
    ) -> Callable[[Callable[..., T]], Callable[..., T | None]]:
        """A decorator: the function runs on rank 0 of `process_group` only, and returns None
        on the other ranks (`@coordinator.on_master_only()`)."""

        def decorator(fn: Callable[..., T]) -> Callable[..., T | None]:
            @functools.wraps(fn)
            def run(*args: Any, **kwargs: Any) -> T | None:
                return fn(*args, **kwargs) if self.is_master(process_group) else None

            return run

        return decorator
