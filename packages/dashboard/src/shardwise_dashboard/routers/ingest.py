"""POST /api/v1/events: batches of telemetry events from the ranks of runs."""

from __future__ import annotations

from fastapi import APIRouter

from shardwise_dashboard.deps import HubDep, TokenDep, WriterDep
from shardwise_dashboard.models import IngestResult
from shardwise_dashboard.schema import EventBatch
from shardwise_dashboard.storage import event_bodies

router = APIRouter(prefix="/api/v1", tags=["ingest"])


@router.post(
    "/events",
    dependencies=[TokenDep],
    responses={
        401: {"description": "A token is required and none was sent."},
        403: {"description": "The token sent is wrong."},
        413: {"description": "The body is over the size limit."},
        422: {"description": "Malformed JSON, a wrong type or field, or another schema version."},
        503: {
            "description": "Another process holds the database's lock: retry after the "
            "`Retry-After` header's seconds; nothing was stored."
        },
    },
)
async def ingest(batch: EventBatch, writer: WriterDep, hub: HubDep) -> IngestResult:
    """Validate a batch of events, store it, then push it to live streams.

    The batch is stored whole or refused whole; the answer comes after the commit, so an
    accepted event survives a restart of the dashboard. Batches that arrive together share a
    transaction (group commit, off the event loop, which serves the live streams). A body
    sent with `Content-Encoding: gzip` is accepted."""
    events = batch.model_dump(mode="json", by_alias=True)["events"]
    # Made once: stored and streamed as is.
    bodies = event_bodies(events)
    await writer.write(events, bodies)
    hub.publish(events, bodies)
    return IngestResult(accepted=len(events))
