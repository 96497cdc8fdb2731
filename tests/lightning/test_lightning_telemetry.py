"""The Lightning strategies stream telemetry when the environment says where, with nothing in
the script: a user with SHARDWISE_DASHBOARD_URL (here SHARDWISE_TELEMETRY_FILE) set sees the
fit, one event per optimizer step, reported finished when the fit ends."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from lightning_cases import fit

from shardwise.testing import run_ranks
from shardwise_lightning import FullyShardedStrategy, GeminiStrategy

STRATEGIES = {"gemini": GeminiStrategy, "fsdp": FullyShardedStrategy}


def _fit_streamed(name: str, path: str) -> dict[str, Any]:
    os.environ["SHARDWISE_TELEMETRY_FILE"] = path  # this rank's process only
    result = fit(STRATEGIES[name]())
    lines = Path(f"{path}.rank{dist.get_rank()}.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    return {"types": [e["type"] for e in events], "steps": len(result.losses)}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_fit_streams_from_the_environment_alone(name: str, tmp_path: Path) -> None:
    for seen in run_ranks(_fit_streamed, 2, name, str(tmp_path / "events")):
        types = seen["types"]
        assert types[0] == "run_started" and types[-1] == "run_finished", types
        assert types.count("step") == seen["steps"] > 0, seen
