"""The forked-rank harness every multi-rank test stands on: results come back in rank order,
a failing rank is named, and a process group that fails to form (gloo's mesh failing to
connect) is started again rather than failing the test."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import RankFailure, run_ranks

MESH_ERROR = (
    "Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:46760"
)


def _rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def test_results_come_back_in_rank_order() -> None:
    assert run_ranks(_rank_and_world, 3) == [(0, 3), (1, 3), (2, 3)]


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one says no")


def test_a_failing_rank_is_named_with_its_error() -> None:
    with pytest.raises(RankFailure, match=r"(?s)rank 1 failed.*rank one says no"):
        run_ranks(_fail_on_rank_one, 2)


def _init_failing(
    tmp_path: Path, message: str, times: int, error: type[Exception] = RuntimeError
) -> Any:
    """An init_process_group whose first `times` calls (over all ranks and starts) raise
    `error(message)`; every call leaves a file in `tmp_path`, so the test can count them."""
    real = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        # O_EXCL: each call claims the next free number, whichever rank makes it.
        number = 0
        while True:
            try:
                os.close(os.open(tmp_path / f"call-{number}", os.O_CREAT | os.O_EXCL))
                break
            except FileExistsError:
                number += 1
        if number < times:
            raise error(message)
        real(*args, **kwargs)

    return init_process_group


def test_a_mesh_that_fails_to_connect_is_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first call fails as gloo's does now and then; its group is killed and a fresh one
    # is started, which connects.
    monkeypatch.setattr(dist, "init_process_group", _init_failing(tmp_path, MESH_ERROR, 1))
    assert run_ranks(_rank_and_world, 2) == [(0, 2), (1, 2)]
    assert len(list(tmp_path.iterdir())) >= 3  # the failed group's call(s), then two more


def test_a_mesh_that_never_connects_fails_after_a_few_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "init_process_group", _init_failing(tmp_path, MESH_ERROR, 1000))
    with pytest.raises(RankFailure, match="connectFullMesh"):
        run_ranks(_rank_and_world, 2)
    calls = len(list(tmp_path.iterdir()))
    assert 3 <= calls <= 6, calls  # three starts, of one or two failing ranks each


def test_bad_arguments_to_start_are_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = _init_failing(tmp_path, "bad backend", 1000, error=ValueError)
    monkeypatch.setattr(dist, "init_process_group", bad)
    with pytest.raises(RankFailure, match="bad backend"):
        run_ranks(_rank_and_world, 2)
    assert len(list(tmp_path.iterdir())) <= 2  # one start: no rank's call was made twice


def test_a_parent_that_initialised_cuda_spawns_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # A child forked after CUDA was initialised cannot use it: such a parent (and any NCCL
    # group) spawns fresh interpreters, which get the function by pickling. A spawned rank
    # imports this module afresh, so it does not see the value set here (a forked one would);
    # the environment reaches it either way.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setenv("SHARDWISE_TEST_MARKER", "set")  # inherited either way
    global _FORK_ONLY
    _FORK_ONLY = "parent"
    try:
        assert run_ranks(_seen_by_rank, 2) == [(0, "set", "unset"), (1, "set", "unset")]
    finally:
        _FORK_ONLY = "unset"


def test_a_parent_without_cuda_forks_its_ranks() -> None:
    global _FORK_ONLY
    _FORK_ONLY = "parent"
    try:
        assert run_ranks(_seen_by_rank, 1) == [(0, None, "parent")]
    finally:
        _FORK_ONLY = "unset"


_FORK_ONLY = "unset"


def _seen_by_rank() -> tuple[int, str | None, str]:
    return dist.get_rank(), os.environ.get("SHARDWISE_TEST_MARKER"), _FORK_ONLY
