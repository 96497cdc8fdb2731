"""The application factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from shardwise_dashboard import __version__
from shardwise_dashboard.live import LiveHub
from shardwise_dashboard.routers import health, ingest, page, runs, stream
from shardwise_dashboard.settings import Settings
from shardwise_dashboard.storage import RunStore


def create_app(settings: Settings) -> FastAPI:
    """Build the dashboard: ingestion, run history, live stream and page over one SQLite file.

    The store is opened here (so a bad --db fails at start, not at the first request) and
    closed when the server shuts down.

    Args:
        settings: database file, token, body size limit, live stream tuning.
    """
    store = RunStore(settings.db_path)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        store.close()

    app = FastAPI(
        title="shardwise dashboard",
        version=__version__,
        description="Live telemetry of shardwise training runs: ingestion of schema-v1 events, "
        "run history, a Server-Sent Events stream and the page that shows them.",
        lifespan=lifespan,
        # Enforced as the body arrives: a declared or streamed body over it gets 413.
        max_body_size=settings.max_body_bytes,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.hub = LiveHub(settings.stream_queue_size)
    for router in (ingest.router, runs.router, stream.router, health.router, page.router):
        app.include_router(router)
    app.mount("/static", page.static_files(), name="static")
    app.add_exception_handler(RequestValidationError, _invalid_request)
    return app


async def _invalid_request(request: Request, error: Exception) -> JSONResponse:
    """422 naming where and why, without echoing the input back: it may be megabytes, or hold
    a NaN that JSON cannot carry."""
    assert isinstance(error, RequestValidationError)
    problems = [
        {"loc": list(problem["loc"]), "msg": problem["msg"], "type": problem["type"]}
        for problem in error.errors()
    ]
    return JSONResponse({"detail": problems}, status_code=422)
