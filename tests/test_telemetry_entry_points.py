"""Every front door streams telemetry when the environment says where, with no call in the
script: `zero_optim_wrapper`, both Booster ZeRO plugins and ShardedOptimizerV2 (the Lightning
strategies and the Trainer callback are tested beside their own suites). One recorder per
optimizer: a script that also calls `telemetry.enable` gets that recorder, and naming another
destination then is refused. The run says which front door started it, from which script, under
the name SHARDWISE_RUN_NAME gives it, and rank 0 alone prints its id and destination."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, make_model

from shardwise import (
    HybridAdam,
    ShardedModelV2,
    ShardedOptimizerV2,
    TensorShardStrategy,
    telemetry,
    zero_model_wrapper,
    zero_optim_wrapper,
)
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
from shardwise.testing import run_ranks

STEPS = 3


def _zero_optim_wrapper() -> tuple[Any, Any, Callable[[Any], None]]:
    model = make_model()
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL}
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return wrapped, optimizer, optimizer.backward


def _booster(plugin: Any) -> tuple[Any, Any, Callable[[Any], None]]:
    booster = Booster(plugin=plugin)
    model = make_model()
    boosted, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-2))
    return boosted, optimizer, lambda loss: booster.backward(loss, optimizer)


def _sharded_v2() -> tuple[Any, Any, Callable[[Any], None]]:
    model = make_model()
    sharded = ShardedModelV2(model, TensorShardStrategy())
    optimizer = ShardedOptimizerV2(sharded, HybridAdam(model.parameters(), lr=1e-2))
    return sharded, optimizer, optimizer.backward


FRONT_DOORS: dict[str, Callable[[], tuple[Any, Any, Callable[[Any], None]]]] = {
    "zero_optim_wrapper": _zero_optim_wrapper,
    "Booster GeminiPlugin": lambda: _booster(GeminiPlugin(precision="fp32")),
    "Booster LowLevelZeroPlugin": lambda: _booster(LowLevelZeroPlugin(stage=2, precision="fp32")),
    "ShardedOptimizerV2": _sharded_v2,
}
RUN_NAME = "lr-sweep 3e-4"


def _streamed(name: str, path: str) -> dict[str, Any]:
    os.environ["SHARDWISE_TELEMETRY_FILE"] = path  # this rank's process only
    os.environ["SHARDWISE_RUN_NAME"] = RUN_NAME
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        model, optimizer, backward = FRONT_DOORS[name]()
    for step in range(STEPS):  # no telemetry call in the script
        optimizer.zero_grad()
        backward(model(*batch_slice(step, 0, dist.get_rank(), 2)))
        optimizer.step()
    engine = getattr(optimizer, "engine", optimizer)  # the Booster's wrapper holds it
    # A script's own enable() gets the recorder the front door started; another destination
    # is refused rather than starting a second run.
    try:
        telemetry.enable(model, engine, path=path + ".other")
        refused = ""
    except ValueError as error:
        refused = str(error)
    # Dropped, the run is reported finished and its events delivered.
    del model, optimizer, backward, engine
    gc.collect()
    lines = Path(f"{path}.rank{dist.get_rank()}.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    return {
        "types": [e["type"] for e in events],
        "refused": refused,
        "started": events[0],
        "said": said.getvalue(),
    }


@pytest.mark.parametrize("name", list(FRONT_DOORS))
def test_every_front_door_streams_from_the_environment_alone(name: str, tmp_path: Path) -> None:
    results = run_ranks(_streamed, 2, name, str(tmp_path / "events"))
    for seen in results:
        types = seen["types"]
        assert types.count("run_started") == 1 and types.count("run_finished") == 1, types
        assert types.count("step") == STEPS, types
        assert "already streams" in seen["refused"], seen
        started = seen["started"]
        assert started["entry_point"] == name and started["run_name"] == RUN_NAME, started
        assert started["script"] == sys.argv[0], started
    # Rank 0 says where the run goes, once; the other ranks keep quiet.
    said = [seen["said"] for seen in results]
    run_id = results[0]["started"]["run_id"]
    assert said[0] == (
        f"shardwise: telemetry of run {run_id} ('{RUN_NAME}', {name}, "
        f"{os.path.basename(sys.argv[0])}) goes to {tmp_path / 'events'}.rank*.jsonl\n"
    ), said
    assert said[1] == "", said
