"""The Lightning strategies stream telemetry when the environment says where, with nothing in
the script: a user with SHARDWISE_DASHBOARD_URL (here SHARDWISE_TELEMETRY_FILE) set sees the
fit, one event per optimizer step, reported finished when the fit ends. Under gradient
accumulation a step's loss is the mean of its micro-batches' training_step losses, the loss
Lightning logs for the step, not the last one divided by the number of micro-batches. The run
says it was started by the strategy ("Lightning GeminiStrategy")."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from lightning_cases import fit

from shardwise.testing import run_ranks
from shardwise_lightning import FullyShardedStrategy, GeminiStrategy

STRATEGIES = {"gemini": GeminiStrategy, "fsdp": FullyShardedStrategy}


MICRO = 2


def _fit_streamed(name: str, path: str, micro: int = 1) -> dict[str, Any]:
    os.environ["SHARDWISE_TELEMETRY_FILE"] = path  # this rank's process only
    result = fit(STRATEGIES[name](), accumulate_grad_batches=micro)
    lines = Path(f"{path}.rank{dist.get_rank()}.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    return {
        "types": [e["type"] for e in events],
        "entry_point": events[0]["entry_point"],
        "steps": len(result.losses) // micro,
        "losses": [e["loss"] for e in events if e["type"] == "step"],
        "micro_losses": result.losses,
    }


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_fit_streams_from_the_environment_alone(name: str, tmp_path: Path) -> None:
    for seen in run_ranks(_fit_streamed, 2, name, str(tmp_path / "events")):
        types = seen["types"]
        assert types[0] == "run_started" and types[-1] == "run_finished", types
        assert types.count("step") == seen["steps"] > 0, seen
        assert seen["entry_point"] == f"Lightning {STRATEGIES[name].__name__}", seen


def test_accumulated_steps_report_the_mean_of_their_micro_batches(tmp_path: Path) -> None:
    for seen in run_ranks(_fit_streamed, 2, "gemini", str(tmp_path / "events"), MICRO):
        micro = seen["micro_losses"]
        logged = [sum(micro[i : i + MICRO]) / MICRO for i in range(0, len(micro), MICRO)]
        assert len(seen["losses"]) == len(logged) == 4, seen
        last = micro[MICRO - 1 :: MICRO]
        for shown, mean, final in zip(seen["losses"], logged, last, strict=True):
            # fp32 sums of two halves against a float64 mean.
            assert math.isclose(shown, mean, rel_tol=1e-6), seen
            assert not math.isclose(shown, final / MICRO, rel_tol=1e-3), seen
