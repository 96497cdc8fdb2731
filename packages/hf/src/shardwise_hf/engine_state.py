"""The sharded engine state inside Trainer checkpoints, and finding it again on resume.

A Trainer checkpoint `checkpoint-<step>/` gets a `shardwise/` entry written by
`shardwise.checkpoint.save` (every rank its shards: fp32 masters, optimizer state, loss scaler).
The Trainer does not tell callbacks which checkpoint `train(resume_from_checkpoint=...)` was
given, only the restored `TrainerState`; so each save is stamped with a token that also goes
into trainer_state.json (the callback is an `ExportableState`), and on resume the entry whose
stamp matches the restored state is the one loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardwise import ZeroModel, ZeroOptimizer, checkpoint

ENTRY = "shardwise"


def save(checkpoint_dir: str, model: ZeroModel, optimizer: ZeroOptimizer, token: str) -> None:
    """Write the engine state into `checkpoint_dir`/shardwise. A collective."""
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    checkpoint.save(Path(checkpoint_dir) / ENTRY, model, optimizer, extra={"token": token})


def candidates(output_dir: str, global_step: int, recorded: dict[str, Any]) -> list[Path]:
    """Where the engine state of the checkpoint at `global_step` may be: where it was written
    (recorded in trainer_state.json), and the Trainer's usual place under `output_dir`."""
    places = []
    if recorded.get("checkpoint_dir"):
        places.append(Path(recorded["checkpoint_dir"]) / ENTRY)
    places.append(Path(output_dir) / f"checkpoint-{global_step}" / ENTRY)
    return [Path(p) for p in dict.fromkeys(os.path.abspath(p) for p in places)]


def load_matching(
    places: list[Path], token: str, model: ZeroModel, optimizer: ZeroOptimizer
) -> Path:
    """Load the first of `places` whose stamp is `token` and return it; a collective. Raises a
    ValueError naming every place tried when none matches."""
    tried = []
    for place in places:
        if not place.exists():
            tried.append(f"{place} (absent)")
            continue
        extra = checkpoint.load(place, model, optimizer)
        if isinstance(extra, dict) and extra.get("token") == token:
            return place
        tried.append(f"{place} (written by another run)")
    raise ValueError(
        "resuming needs the sharded engine state saved with this checkpoint, not found in: "
        + "; ".join(tried)
        + ". Resume from a checkpoint written by a run with ShardwiseCallback, kept in place"
    )
