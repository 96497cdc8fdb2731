"""GET /api/v1/placement/{run_id}?rank=R: where one rank's chunks sat, step by step."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from shardwise_dashboard.deps import StoreDep
from shardwise_dashboard.models import PlacementTimeline
from shardwise_dashboard.schema import MAX_RANK

router = APIRouter(prefix="/api/v1", tags=["placement"])

MAX_SNAPSHOTS = 10_000


@router.get(
    "/placement/{run_id:path}",
    response_model=PlacementTimeline,
    responses={404: {"description": "No event of this run was ever ingested."}},
)
async def get_placement(
    run_id: Annotated[str, Path(min_length=1, max_length=128)],
    store: StoreDep,
    rank: Annotated[int, Query(ge=0, lt=MAX_RANK, description="The rank.")],
    max_snapshots: Annotated[
        int,
        Query(
            ge=2,
            le=MAX_SNAPSHOTS,
            description="Thin to about this many snapshots (every k-th, and the latest).",
        ),
    ] = 1000,
) -> JSONResponse:
    """One rank's placement timeline: per chunk snapshot (`steps`), one letter per chunk for
    its 16-bit payload (`placement`: D/d on the device gathered/sharded, H/h on the host) and
    for its fp32 master and optimizer state (`optim`: D device, H host, S the disk tier, -
    none)."""
    timeline = await run_in_threadpool(store.placement_timeline, run_id, rank, max_snapshots)
    if timeline is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    return JSONResponse(timeline)
