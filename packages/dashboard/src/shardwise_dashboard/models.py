"""Response bodies of the API, for validation-free documentation in the OpenAPI schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from shardwise_dashboard.schema import Chunks, Eval, Step


class IngestResult(BaseModel):
    accepted: int
    """Events stored from this batch (all of them: a batch is stored whole or not at all)."""


class Health(BaseModel):
    status: Literal["ok"]
    schema_version: int
    num_streams: int
    num_events: int


Status = Literal["running", "finished", "failed", "stale"]
"""stale: not finished, and nothing arrived for longer than the server's --stale-after."""


class RunSummary(BaseModel):
    run_id: str
    status: Status
    started: float
    last_seen: float
    received: float
    """When this server last received an event of the run (its clock, Unix seconds)."""
    world_size: int | None
    num_params: int | None
    ranks_seen: int
    ranks_finished: int
    ranks_warned: int
    """Ranks whose steps carried an engine warning."""
    last_step: int
    dropped: int
    run_name: str | None
    """The name the user gave the run (SHARDWISE_RUN_NAME, the Trainer's run_name)."""
    entry_point: str | None
    """The front door that started it ("zero_optim_wrapper", "Booster GeminiPlugin",
    "Lightning GeminiStrategy", "HF Trainer", ...)."""
    script: str | None
    """The command's script (sys.argv[0] on rank 0)."""


class RankDetail(BaseModel):
    rank: int
    status: Status
    error: str | None
    host: str | None
    last_step: int
    num_steps: int
    dropped: int
    last_seen: float
    received: float
    skipped_in_a_row: int
    """At the rank's latest step: consecutive steps skipped for non-finite gradients."""
    warning: str | None
    """The latest engine warning the rank's steps carried (see warning_step)."""
    warning_step: int | None
    first_overflow: int | None
    first_overflow_time: float | None
    placement: str | None
    """One letter per chunk of the latest snapshot: D/d payload on the device (gathered /
    sharded), H/h on the host."""
    placement_step: int | None
    steps: list[Step]
    evals: list[Eval]
    """The rank's evaluations in step order (thinned as its steps are, to max_points)."""
    chunks: Chunks | None


class RunDetail(RunSummary):
    config: dict[str, Any] | None
    ranks: list[RankDetail]


class PlacementTimeline(BaseModel):
    run_id: str
    rank: int
    steps: list[int]
    """Steps of the rank's chunk snapshots, ascending (thinned to max_snapshots)."""
    placement: list[str]
    """Per snapshot, one letter per chunk: D/d payload on the device (gathered / sharded),
    H/h on the host."""
    optim: list[str]
    """Per snapshot, one letter per chunk for its master and optimizer state: D device,
    H host, - none (frozen)."""
