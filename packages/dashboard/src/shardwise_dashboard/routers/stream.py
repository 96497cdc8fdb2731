"""GET /api/v1/stream: Server-Sent Events of freshly ingested events, for the page."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from shardwise_dashboard.deps import HubDep, SettingsDep

router = APIRouter(prefix="/api/v1", tags=["stream"])

_DESCRIPTION = """\
A `text/event-stream`. Messages:
- `hello` (data `{}`): the stream is subscribed; events ingested from now on will follow, so
  load history (the runs endpoints) after this message and merge.
- `events` (data: a JSON array of schema-v1 events, as ingested).
- `resync` (data `{}`): this stream fell behind and lost messages; reload from history.
Comment lines keep an idle connection open."""


@router.get(
    "/stream",
    response_class=StreamingResponse,
    description=_DESCRIPTION,
    responses={200: {"content": {"text/event-stream": {}}, "description": "The stream."}},
)
async def stream(
    hub: HubDep,
    settings: SettingsDep,
    run_id: Annotated[
        str | None, Query(min_length=1, max_length=128, description="Follow one run only.")
    ] = None,
    limit: Annotated[
        int | None,
        Query(ge=1, le=2**31, description="Close after this many `events` messages."),
    ] = None,
) -> StreamingResponse:
    """Live events, optionally of one run."""

    async def messages() -> AsyncIterator[str]:
        subscriber = hub.subscribe(run_id)
        try:
            yield "retry: 2000\nevent: hello\ndata: {}\n\n"
            sent = 0
            while limit is None or sent < limit:
                try:
                    data = await asyncio.wait_for(subscriber.queue.get(), settings.keepalive_s)
                except TimeoutError:
                    # Also how a vanished browser is noticed: the write fails.
                    yield ": keep-alive\n\n"
                    continue
                if subscriber.lagged:
                    subscriber.lagged = False
                    yield "event: resync\ndata: {}\n\n"
                yield f"event: events\ndata: {data}\n\n"
                sent += 1
        finally:
            hub.unsubscribe(subscriber)

    return StreamingResponse(
        messages(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
