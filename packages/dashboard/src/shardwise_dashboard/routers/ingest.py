"""POST /api/v1/events: batches of telemetry events from the ranks of runs."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from shardwise_dashboard.deps import HubDep, StoreDep, TokenDep
from shardwise_dashboard.models import IngestResult
from shardwise_dashboard.schema import EventBatch

router = APIRouter(prefix="/api/v1", tags=["ingest"])


@router.post(
    "/events",
    dependencies=[TokenDep],
    responses={
        401: {"description": "A token is required and none was sent."},
        403: {"description": "The token sent is wrong."},
        413: {"description": "The body is over the size limit."},
        422: {"description": "Malformed JSON, a wrong type or field, or another schema version."},
    },
)
async def ingest(batch: EventBatch, store: StoreDep, hub: HubDep) -> IngestResult:
    """Validate a batch of events, store it in one transaction, then push it to live streams.

    The batch is stored whole or refused whole; the answer comes after the commit, so an
    accepted event survives a restart of the dashboard."""
    events = [event.model_dump(mode="json", by_alias=True) for event in batch.events]
    # SQLite blocks: keep it off the event loop, which serves the live streams.
    await run_in_threadpool(store.add, events)
    hub.publish(events)
    return IngestResult(accepted=len(events))
