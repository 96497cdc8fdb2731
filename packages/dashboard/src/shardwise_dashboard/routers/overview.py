"""GET /api/v1/overview/{run_id}: one run at a glance, at any rank count."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from shardwise_dashboard import overview
from shardwise_dashboard.deps import StoreDep

router = APIRouter(prefix="/api/v1", tags=["overview"])

MAX_STEPS = 10_000


@router.get(
    "/overview/{run_id:path}",
    responses={404: {"description": "No event of this run was ever ingested."}},
)
async def get_overview(
    run_id: Annotated[str, Path(min_length=1, max_length=128)],
    store: StoreDep,
    steps: Annotated[
        int,
        Query(ge=1, le=MAX_STEPS, description="How many of the latest steps to summarise."),
    ] = 300,
    since_step: Annotated[
        int,
        Query(
            ge=-1,
            le=2**63 - 1,
            description="Return distributions only of steps after this one (live refresh).",
        ),
    ] = -1,
) -> JSONResponse:
    """The run's summary; per rank its status, silence, warning, first overflow and chunk
    placement (`placement`: one letter per chunk, D/d payload on the device gathered/sharded,
    H/h on the host); per step the min / median / max across ranks of step time, bytes sent,
    bytes moved host<->device and memory per pool; and the outlier ranks (engine warnings,
    failed and stale ranks, first overflow, slowest step, most traffic, highest memory)."""
    rows = await run_in_threadpool(store.overview_rows, run_id, steps)
    if rows is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    summary, ranks, step_rows = rows
    return JSONResponse(overview.build(summary, ranks, step_rows, since_step))
