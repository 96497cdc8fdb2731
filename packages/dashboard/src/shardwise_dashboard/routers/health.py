"""GET /api/v1/health: is the server up, and what does it speak."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from shardwise_dashboard.deps import HubDep, StoreDep
from shardwise_dashboard.models import Health
from shardwise_dashboard.schema import SCHEMA_VERSION

router = APIRouter(prefix="/api/v1", tags=["health"])


@router.get("/health")
async def health(store: StoreDep, hub: HubDep) -> Health:
    """Liveness, the event schema version spoken, live streams open, events stored."""
    return Health(
        status="ok",
        schema_version=SCHEMA_VERSION,
        num_streams=hub.num_subscribers,
        num_events=await run_in_threadpool(store.count_events),
    )
