"""The application factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from shardwise_dashboard import __version__
from shardwise_dashboard.compression import GzipRequestBody
from shardwise_dashboard.live import LiveHub
from shardwise_dashboard.retention import Retention
from shardwise_dashboard.routers import health, ingest, overview, page, placement, runs, stream
from shardwise_dashboard.schema import EventBatch
from shardwise_dashboard.settings import Settings
from shardwise_dashboard.storage import RunStore, StoreBusy
from shardwise_dashboard.writer import BatchWriter

# Seconds a sender is asked to wait when another process holds the database's lock.
RETRY_AFTER_S = 1


def create_app(settings: Settings) -> FastAPI:
    """Build the dashboard: ingestion, run history, live stream and page over one SQLite file.

    The store is opened here (so a bad --db fails at start with a `StoreError`, not at the
    first request) and closed when the server shuts down.

    Args:
        settings: database file, token, body size limit, live stream tuning, staleness and
            retention.
    """
    store = RunStore(
        settings.db_path,
        busy_timeout_s=settings.busy_timeout_s,
        stale_after_s=settings.stale_after_s,
    )
    retention = Retention(
        store,
        max_age_s=None if settings.retain_days is None else settings.retain_days * 86400,
        max_bytes=settings.max_db_bytes,
        thin_after_s=settings.thin_after_s,
        thin_every=settings.thin_every,
    )
    writer = BatchWriter(
        store,
        maintenance=retention.run_once,
        maintenance_interval_s=settings.maintenance_interval_s,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        writer.close()
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
    app.state.writer = writer
    app.state.retention = retention
    app.state.hub = LiveHub(settings.stream_queue_size)
    routers = (
        ingest.router,
        runs.router,
        overview.router,
        placement.router,
        stream.router,
        health.router,
    )
    for router in (*routers, page.router):
        app.include_router(router)
    app.mount("/static", page.static_files(), name="static")
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StoreBusy, _busy)
    app.add_middleware(GzipRequestBody, max_body_bytes=settings.max_body_bytes)
    _document_event_batch(app)
    return app


def _document_event_batch(app: FastAPI) -> None:
    """Put the ingestion body's schema (EventBatch and the events in it) in the OpenAPI
    components: the ingest route parses its body itself, so FastAPI does not see the model."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = generate()
            schema = EventBatch.model_json_schema(ref_template="#/components/schemas/{model}")
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            components.update(schema.pop("$defs", {}))
            components["EventBatch"] = schema
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _busy(request: Request, error: Exception) -> JSONResponse:
    """Another process holds the database: nothing was stored, the sender may try again."""
    return JSONResponse(
        {"detail": f"{error}; nothing was stored, retry after {RETRY_AFTER_S} s"},
        status_code=503,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _invalid_request(request: Request, error: Exception) -> JSONResponse:
    """422 naming where and why, without echoing the input back: it may be megabytes, or hold
    a NaN that JSON cannot carry."""
    assert isinstance(error, RequestValidationError)
    problems = [
        {"loc": list(problem["loc"]), "msg": problem["msg"], "type": problem["type"]}
        for problem in error.errors()
    ]
    return JSONResponse({"detail": problems}, status_code=422)
