"""ColossalAI's launch and coordinator paths (`colossalai.launch_from_torch`,
`colossalai.cluster.DistCoordinator`) as `shardwise.launch_from_torch` and
`shardwise.cluster.DistCoordinator`, run under torchrun as a ColossalAI script is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import torchrun

import shardwise

HERE = Path(__file__).resolve().parent


def test_launch_from_torch_starts_the_group_and_the_coordinator_names_the_ranks(
    tmp_path: Path,
) -> None:
    done = torchrun(HERE / "launch_run.py", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, seen in enumerate(ranks):
        assert seen["rank"] == rank and seen["local_rank"] == rank
        assert seen["world_size"] == 2 and seen["same_object"]
        assert seen["is_master"] == (rank == 0) and seen["is_last"] == (rank == 1)
        assert seen["on_master_only"] == ("ran" if rank == 0 else None)
        assert seen["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
    assert ranks[0]["draws"] == ranks[1]["draws"]  # seeded alike
    # The executor (rank 0) ran its body first although it was the slow one.
    assert (tmp_path / "order.txt").read_text().split() == ["0", "1"]
    assert done.stdout.count("printed by rank") == 1 and "printed by rank 0" in done.stdout


def test_launch_from_torch_outside_torchrun_says_how_to_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node"):
        shardwise.launch_from_torch()


def test_launch_refuses_what_it_cannot_start() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend='nccl' needs CUDA"):
            shardwise.launch(0, 1, "127.0.0.1", 29500, backend="nccl")
    with pytest.raises(ValueError, match="backend must be"):
        shardwise.launch(0, 1, "127.0.0.1", 29500, backend="mpi")
    with pytest.raises(ValueError, match="rank must be in"):
        shardwise.launch(2, 2, "127.0.0.1", 29500)
