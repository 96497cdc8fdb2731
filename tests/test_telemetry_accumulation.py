"""Under gradient accumulation a step's loss in telemetry is the loss the loop logs: the mean of
the step's micro-batch losses (each handed to backward divided by the number of micro-batches,
as the HF Trainer and Lightning divide it), not the last micro-batch's share of it."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, make_model

from shardwise import HybridAdam, telemetry, zero_model_wrapper, zero_optim_wrapper
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin
from shardwise.testing import run_ranks

STEPS, MICRO = 3, 3


def _wrapper() -> tuple[Any, Any, Callable[[Any], None]]:
    model = make_model()
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL}
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return wrapped, optimizer, optimizer.backward


def _booster() -> tuple[Any, Any, Callable[[Any], None]]:
    booster = Booster(plugin=GeminiPlugin(precision="fp32"))
    model = make_model()
    boosted, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-2))
    return boosted, optimizer, lambda loss: booster.backward(loss, optimizer)


FRONT_DOORS = {"zero_optim_wrapper": _wrapper, "GeminiPlugin": _booster}


def _train(name: str) -> tuple[list[float], list[float]]:
    """STEPS steps of MICRO micro-batches each: the mean of each step's micro-batch losses,
    and the last one's share of it."""
    rank = dist.get_rank()
    model, optimizer, backward = FRONT_DOORS[name]()
    logged, last_shares = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = []
        for micro in range(MICRO):
            loss = model(*batch_slice(step, micro, rank, 2))
            backward(loss / MICRO)
            losses.append(float(loss.detach()))
        optimizer.step()
        logged.append(sum(losses) / MICRO)
        last_shares.append(losses[-1] / MICRO)
    # The recorder the front door started: finished, its events are all written.
    recorder = telemetry.enable(model, getattr(optimizer, "engine", optimizer))
    assert recorder is not None
    recorder.finish()
    return logged, last_shares


def _accumulate(name: str, path: str) -> dict[str, Any]:
    os.environ["SHARDWISE_TELEMETRY_FILE"] = path  # this rank's process only
    logged, last_shares = _train(name)
    lines = Path(f"{path}.rank{dist.get_rank()}.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if '"type": "step"' in line]
    return {"logged": logged, "last_shares": last_shares, "seen": [e["loss"] for e in steps]}


@pytest.mark.parametrize("name", list(FRONT_DOORS))
def test_a_step_reports_the_mean_of_its_micro_batches(name: str, tmp_path: Path) -> None:
    for result in run_ranks(_accumulate, 2, name, str(tmp_path / "events")):
        seen, logged = result["seen"], result["logged"]
        assert len(seen) == STEPS, result
        for shown, mean, share in zip(seen, logged, result["last_shares"], strict=True):
            # fp32 sums of three terms against a float64 mean: a few ulps apart.
            assert math.isclose(shown, mean, rel_tol=1e-6), result
            assert not math.isclose(shown, share, rel_tol=1e-3), result
