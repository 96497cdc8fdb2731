"""Run a function on N ranks forked (or spawned) from this process, each in a process group.

Forking a parent that already imported torch starts a rank in well under a second, where a
fresh interpreter (spawn, torchrun) pays seconds for Python and torch imports; tests start many
groups, so they fork.

A child forked after its parent asked torch anything of CUDA (even `torch.cuda.is_available()`,
which pytest's skip markers call) cannot use CUDA ("Cannot re-initialize CUDA in forked
subprocess"), and there is no way to ask whether the parent did. So ranks that use CUDA, the
NCCL backend's, and any rank of a parent that initialised CUDA, are spawned instead: fresh
interpreters that receive the function and its arguments by pickling (so both must be
importable and picklable there), a few seconds each. Nor can a forked child use autograd once
its parent ran a backward pass on a machine with a GPU (torch starts its device threads then,
and marks forked children): tests/conftest.py runs none there.

Gloo's mesh of loopback connections, set up inside `init_process_group`, now and then fails to
connect ("Gloo connectFullMesh failed ... Connection closed by peer": twice in some 700 groups
started back to back here). A rank whose `init_process_group` raises a RuntimeError (a
transport failure; bad arguments raise ValueError or TypeError) reports it as such, and the
group is started again, afresh, a few times before the failure is reported. Its peers may have
begun the function already: what they did in the killed group is lost with their processes,
and the function runs again from the start in the next.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class RankFailure(RuntimeError):
    """A rank raised, died, or did not finish in time; the message names the rank."""


class _StartFailure(RankFailure):
    """A rank's process group failed to form (see the module note)."""


# Starts of a group whose process group failed to form (see the module note).
_STARTS = 3


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    **kwargs: Any,
) -> list[T]:
    """Run `fn(*args, **kwargs)` on `world_size` forked (or spawned) ranks inside an
    initialised process group and return each rank's result, in rank order.

    Results travel back through `torch.save`, so tensors arrive intact. If a rank raises, the
    others are killed at once (they may be waiting in a collective) and `RankFailure` carries
    that rank's traceback; a rank still running after `timeout_s` fails the same way.

    Args:
        fn: the per-rank function; it can read its rank from torch.distributed.
        world_size: number of ranks, >= 1.
        *args, **kwargs: passed to `fn` on every rank (inherited through fork, not pickled,
            unless the ranks are spawned: see the module note).
        backend: torch.distributed backend.
        timeout_s: wall-clock limit for the whole group, each time it is started (see the
            module note).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for start in range(1, _STARTS + 1):
        try:
            return _run_group(fn, world_size, args, kwargs, backend, timeout_s)
        except _StartFailure:
            if start == _STARTS:
                raise
    raise AssertionError("unreachable")


def _run_group(
    fn: Callable[..., T],
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: str,
    timeout_s: float,
) -> list[T]:
    # See the module note: a forked child may be unable to use CUDA.
    uses_cuda = backend == "nccl" or torch.cuda.is_initialized()
    context = mp.get_context("spawn") if uses_cuda else mp.get_context("fork")
    fd, store_path = tempfile.mkstemp(prefix="shardwise-pg-")
    os.close(fd)
    os.unlink(store_path)  # the file store creates it; a stale file would confuse it
    pipes: list[Connection] = []
    processes: list[Any] = []
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_rank_main,
                args=(fn, rank, world_size, backend, store_path, timeout_s, sender, args, kwargs),
                daemon=True,
            )
            process.start()
            sender.close()
            pipes.append(receiver)
            processes.append(process)
        return _collect(pipes, processes, timeout_s)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        for pipe in pipes:
            pipe.close()
        if os.path.exists(store_path):
            os.unlink(store_path)


def _collect(pipes: list[Connection], processes: list[Any], timeout_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    pending = dict(enumerate(pipes))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RankFailure(f"ranks {sorted(pending)} did not finish within {timeout_s} s")
        ready = mp.connection.wait(list(pending.values()), timeout=min(remaining, 1.0))
        for rank, pipe in list(pending.items()):
            if pipe not in ready:
                if not processes[rank].is_alive() and not pipe.poll():
                    raise RankFailure(
                        f"rank {rank} died with exit code {processes[rank].exitcode} "
                        f"before reporting a result"
                    )
                continue
            try:
                ok, payload, start_failed = torch.load(
                    io.BytesIO(pipe.recv_bytes()), weights_only=False
                )
            except EOFError:
                raise RankFailure(
                    f"rank {rank} died with exit code {processes[rank].exitcode} "
                    f"before reporting a result"
                ) from None
            if not ok:
                failure = _StartFailure if start_failed else RankFailure
                raise failure(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
            del pending[rank]
    return [results[rank] for rank in range(len(pipes))]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    timeout_s: float,
    sender: Connection,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    code = 0
    start_failed = False
    try:
        torch.set_num_threads(1)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
        )
        try:
            dist.init_process_group(
                backend,
                init_method=f"file://{store_path}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=max(5.0, min(timeout_s, 60.0))),
            )
        except RuntimeError:
            start_failed = True  # run_ranks starts the group again (see the module note)
            raise
        outcome: tuple[bool, Any, bool] = (True, fn(*args, **kwargs), False)
    except BaseException:
        outcome = (False, traceback.format_exc(), start_failed)
        code = 1
    try:
        buffer = io.BytesIO()
        torch.save(outcome, buffer)
        sender.send_bytes(buffer.getvalue())
    except BaseException:
        code = 2
    finally:
        sender.close()
        if dist.is_initialized() and code == 0:
            dist.destroy_process_group()
        # Skip the parent's atexit handlers and pytest machinery inherited through fork.
        os._exit(code)
