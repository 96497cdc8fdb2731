"""What a Trainer run with ShardwiseCallback streams (tests/hf/telemetry_run.py, 2 forked
ranks, SHARDWISE_TELEMETRY_FILE set): the loss of each step is the loss the Trainer logs for it
under gradient accumulation, its evaluations arrive as "eval" events, and the run carries the
Trainer's run_name and says the HF Trainer started it; rank 0 prints where it goes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import transformers
from forked_script import run_script
from telemetry_run import RUN_NAME

import shardwise_hf  # noqa: F401  (imported before the forks)

_ = (transformers.Trainer, transformers.LlamaForCausalLM)  # loaded once, not in every rank

HERE = Path(__file__).resolve().parent
WORLD = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hf_telemetry")
    env = {
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "0",
        "SHARDWISE_TELEMETRY_FILE": str(out / "events"),
    }
    outputs = run_script(HERE / "telemetry_run.py", str(out), out=out / "logs", env=env)
    for rank, output in enumerate(outputs):
        assert output.exit_code == 0, (rank, output.stdout[-2000:] + output.stderr[-4000:])
    events = [
        [json.loads(line) for line in (out / f"events.rank{rank}.jsonl").read_text().splitlines()]
        for rank in range(WORLD)
    ]
    return {
        "events": events,
        "logged": json.loads((out / "logged.json").read_text()),
        "outputs": outputs,
        "files": out / "events",
    }


def test_each_step_shows_the_loss_the_trainer_logs(run: dict[str, Any]) -> None:
    losses = [[e["loss"] for e in rank if e["type"] == "step"] for rank in run["events"]]
    logged = run["logged"]["loss"]
    assert len(logged) == 6 and all(len(mine) == 6 for mine in losses), (logged, losses)
    for index, (step, loss) in enumerate(logged):
        # The Trainer logs the mean over ranks of the step's summed micro-batch losses; the
        # page shows each rank's. fp32 sums of two terms, averaged in another order.
        shown = sum(rank[index] for rank in losses) / WORLD
        assert step == index + 1 and math.isclose(shown, loss, rel_tol=1e-6), (logged, losses)
        # Not the last micro-batch's half of it, as before.
        assert shown > 0.9 * loss, (logged, losses)


def test_the_run_is_named_and_announced(run: dict[str, Any]) -> None:
    started = [rank[0] for rank in run["events"]]
    assert all(e["type"] == "run_started" for e in started), started
    assert {(e["run_name"], e["entry_point"]) for e in started} == {(RUN_NAME, "HF Trainer")}
    assert all(e["script"].endswith("telemetry_run.py") for e in started), started
    said = [
        [line for line in output.stderr.splitlines() if "shardwise: telemetry of run" in line]
        for output in run["outputs"]
    ]
    run_id = started[0]["run_id"]
    assert said[0] == [
        f"shardwise: telemetry of run {run_id} ('{RUN_NAME}', HF Trainer, telemetry_run.py) "
        f"goes to {run['files']}.rank*.jsonl"
    ], said
    assert said[1] == [], said


def test_evaluations_are_streamed(run: dict[str, Any]) -> None:
    logged = run["logged"]["eval"]
    assert [step for step, _ in logged] == [3, 6], logged
    for rank in run["events"]:
        evals = [(e["step"], e["loss"]) for e in rank if e["type"] == "eval"]
        # After the Trainer's step n: the step event numbered n - 1 (the first is 0).
        assert evals == [(step - 1, loss) for step, loss in logged], (evals, logged)
