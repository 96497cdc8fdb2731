"""A Trainer run with ShardwiseCallback streaming telemetry (to the JSON-lines files the test
names in SHARDWISE_TELEMETRY_FILE): 2 micro-batches per step, the loss logged every step,
evaluations at steps 3 and 6, and a run name. Rank 0 writes what the Trainer logged to
logged.json beside the events, for tests/hf/test_trainer_telemetry.py to compare."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from trainer_support import EVALUATING, arguments, build, dataset, eval_history, held_out
from transformers import Trainer

from shardwise_hf import ShardwiseCallback

RUN_NAME = "tiny-llama-accumulating"


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    trainer = Trainer(
        model=build("llama"),
        args=arguments(out / "run", run_name=RUN_NAME, **EVALUATING),
        train_dataset=dataset(),
        eval_dataset=held_out(),
        callbacks=[ShardwiseCallback()],
    )
    trainer.train()
    if dist.get_rank() == 0:
        logged = {
            "loss": [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e],
            "eval": eval_history(trainer),
        }
        (out / "logged.json").write_text(json.dumps(logged))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
