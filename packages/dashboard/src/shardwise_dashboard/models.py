"""Response bodies of the API, for validation-free documentation in the OpenAPI schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from shardwise_dashboard.schema import Chunks, Step


class IngestResult(BaseModel):
    accepted: int
    """Events stored from this batch (all of them: a batch is stored whole or not at all)."""


class Health(BaseModel):
    status: Literal["ok"]
    schema_version: int
    num_streams: int
    num_events: int


class RunSummary(BaseModel):
    run_id: str
    status: Literal["running", "finished", "failed"]
    started: float
    last_seen: float
    world_size: int | None
    num_params: int | None
    ranks_seen: int
    ranks_finished: int
    last_step: int
    dropped: int


class RankDetail(BaseModel):
    rank: int
    status: Literal["running", "finished", "failed"]
    error: str | None
    host: str | None
    last_step: int
    num_steps: int
    dropped: int
    last_seen: float
    steps: list[Step]
    chunks: Chunks | None


class RunDetail(RunSummary):
    config: dict[str, Any] | None
    ranks: list[RankDetail]
