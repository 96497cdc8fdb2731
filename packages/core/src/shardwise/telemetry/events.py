"""The telemetry event schema, version 1: plain JSON objects shared with the dashboard.

Every event: {"schema": 1, "type": str, "run_id": str, "rank": int, "time": unix seconds}, and
by type:
- "run_started": world_size, config (any JSON), num_params, host, run_name (null, or the name
  the user gave the run), entry_point (the front door that started it: "zero_optim_wrapper",
  "Booster GeminiPlugin", "Lightning GeminiStrategy", "HF Trainer", ...), script (the command's
  script, `sys.argv[0]`)
- "step": step, loss (null if not finite or unknown), loss_scale, overflow, grad_norm (null if
  not finite), step_time_s, comm_bytes {collective kind: bytes sent this step},
  comm_bytes_unquantized {collective kind: what those collectives would have sent in the
  unquantized wire formats: comm_bytes itself where nothing is quantized; see [Note:
  unquantized bytes] in comm/stats.py}, moved_bytes
  {"to_device", "to_host", "to_disk", "from_disk"} (the last two: written to and read from the
  disk tier this step), memory {"device", "host", "disk"} (model-state bytes per pool; "disk":
  the disk tier's files),
  skipped_in_a_row (steps skipped in a row up to this one, 0 when it was taken), warning (null,
  or the engine's warning that steps keep being skipped with no loss scale left to lower)
- "chunks": step, chunks [{"id", "numel", "state" ("sharded"|"gathered"), "sharded",
  "payload" ("device"|"host"), "optim" ("device"|"host"|"disk"|null), "tensor_states"
  {state: count}}]
- "eval": step (the index of the optimizer step the evaluation followed, as a "step" event's),
  loss (the evaluation loss; null if not finite)
- "run_finished": status ("finished"|"failed"), error (null or a message)
- "dropped": count (events the emitter could not deliver)
The dashboard validates every field; it never imports torch. "eval" came later than the others
within version 1, a type added beside them rather than a change to one: a dashboard from before
it refuses a batch holding one (it names the type), and `HttpSink` then stops sending it there.
The disk tier's fields ("to_disk", "from_disk", memory "disk", optim "disk") came later too; the
dashboard reads events without them as zero. So did comm_bytes_unquantized, which it reads as
unknown (null) when absent. So did run_started's run_name, entry_point and script, which it
reads as unknown when absent (a dashboard from before them refuses a run_started holding them).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

SCHEMA_VERSION = 1


def _base(kind: str, run_id: str, rank: int) -> dict[str, Any]:
    return {
        "schema": SCHEMA_VERSION,
        "type": kind,
        "run_id": run_id,
        "rank": rank,
        "time": time.time(),
    }


def finite_or_none(value: float | None) -> float | None:
    """JSON has no nan or inf: they travel as null."""
    return None if value is None or not math.isfinite(value) else float(value)


def run_started(
    run_id: str,
    rank: int,
    *,
    world_size: int,
    config: dict[str, Any],
    num_params: int,
    host: str,
    run_name: str | None = None,
    entry_point: str | None = None,
    script: str | None = None,
) -> dict[str, Any]:
    """A rank joined a run; `run_name`, `entry_point` and `script` tell runs apart on the
    dashboard (a script's path keeps its last 255 characters)."""
    return {
        **_base("run_started", run_id, rank),
        "world_size": world_size,
        "config": config,
        "num_params": num_params,
        "host": host,
        "run_name": run_name[:128] if run_name else None,
        "entry_point": entry_point[:128] if entry_point else None,
        "script": script[-255:] if script else None,
    }


def step(
    run_id: str,
    rank: int,
    *,
    step_index: int,
    loss: float | None,
    loss_scale: float,
    overflow: bool,
    grad_norm: float | None,
    step_time_s: float,
    comm_bytes: dict[str, int],
    moved_bytes: dict[str, int],
    memory: dict[str, int],
    skipped_in_a_row: int = 0,
    warning: str | None = None,
    comm_bytes_unquantized: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One optimizer step on one rank; `comm_bytes_unquantized` None: nothing was quantized,
    the same as `comm_bytes`."""
    return {
        **_base("step", run_id, rank),
        "step": step_index,
        "loss": finite_or_none(loss),
        "loss_scale": loss_scale,
        "overflow": overflow,
        "grad_norm": finite_or_none(grad_norm),
        "step_time_s": max(0.0, step_time_s),
        "comm_bytes": comm_bytes,
        "comm_bytes_unquantized": dict(
            comm_bytes if comm_bytes_unquantized is None else comm_bytes_unquantized
        ),
        "moved_bytes": moved_bytes,
        "memory": memory,
        "skipped_in_a_row": skipped_in_a_row,
        "warning": warning[:200] if warning else None,
    }


def chunks(
    run_id: str, rank: int, *, step_index: int, report: list[dict[str, Any]]
) -> dict[str, Any]:
    """A chunk snapshot from `GeminiManager.placement_report()`-shaped rows."""
    return {
        **_base("chunks", run_id, rank),
        "step": step_index,
        "chunks": [
            {
                "id": row["chunk_id"],
                "numel": row["numel"],
                "state": row["state"],
                "sharded": row["sharded"],
                "payload": row["payload"],
                "optim": row["optim"],
                "tensor_states": dict(Counter(row["tensors"].values())),
            }
            for row in report
        ],
    }


def evaluation(run_id: str, rank: int, *, step_index: int, loss: float | None) -> dict[str, Any]:
    """An evaluation's loss, after optimizer step `step_index`."""
    return {**_base("eval", run_id, rank), "step": step_index, "loss": finite_or_none(loss)}


def run_finished(run_id: str, rank: int, *, error: str | None = None) -> dict[str, Any]:
    return {
        **_base("run_finished", run_id, rank),
        "status": "failed" if error else "finished",
        "error": error[:200] if error else None,
    }


def dropped(run_id: str, rank: int, count: int) -> dict[str, Any]:
    return {**_base("dropped", run_id, rank), "count": count}
