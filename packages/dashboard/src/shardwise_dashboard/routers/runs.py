"""GET /api/v1/runs and /api/v1/runs/{run_id}: run history, from the store."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from shardwise_dashboard.deps import StoreDep
from shardwise_dashboard.models import RunDetail, RunSummary
from shardwise_dashboard.schema import MAX_RANK

# Every numeric query parameter is bounded: an unbounded int reaches SQLite as an overflow.
MAX_POINTS = 1_000_000

router = APIRouter(prefix="/api/v1", tags=["runs"])


@router.get("/runs", response_model=list[RunSummary])
async def list_runs(store: StoreDep) -> JSONResponse:
    """Every run, newest first: status (running, finished when every rank finished, failed
    when one failed, stale when nothing arrived for the server's --stale-after), world size,
    ranks seen and finished, last step, events dropped."""
    return JSONResponse(await run_in_threadpool(store.runs))


@router.get(
    "/runs/{run_id:path}",
    response_model=RunDetail,
    responses={404: {"description": "No event of this run was ever ingested."}},
)
async def get_run(
    run_id: Annotated[str, Path(min_length=1, max_length=128)],
    store: StoreDep,
    max_points: Annotated[
        int | None,
        Query(
            ge=2,
            le=MAX_POINTS,
            description="Thin each rank's steps to about this many (every k-th, the last, "
            "and every overflow); default: all.",
        ),
    ] = None,
    rank: Annotated[
        int | None,
        Query(ge=0, lt=MAX_RANK, description="Only this rank (default: every rank)."),
    ] = None,
) -> JSONResponse:
    """One run: its summary and engine config and, per rank, its step events in step order
    and the latest chunk snapshot."""
    detail = await run_in_threadpool(store.run, run_id, max_points, rank)
    if detail is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    # The events were validated when ingested: skip validating thousands of them again.
    return JSONResponse(detail)
