"""Typed dependencies shared by the routers: the store, the live hub, the settings, the token."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request

from shardwise_dashboard.live import LiveHub
from shardwise_dashboard.settings import Settings
from shardwise_dashboard.storage import RunStore
from shardwise_dashboard.writer import BatchWriter


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_store(request: Request) -> RunStore:
    store: RunStore = request.app.state.store
    return store


def get_writer(request: Request) -> BatchWriter:
    writer: BatchWriter = request.app.state.writer
    return writer


def get_hub(request: Request) -> LiveHub:
    hub: LiveHub = request.app.state.hub
    return hub


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[RunStore, Depends(get_store)]
HubDep = Annotated[LiveHub, Depends(get_hub)]
WriterDep = Annotated[BatchWriter, Depends(get_writer)]


def require_token(
    settings: SettingsDep,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> None:
    """Refuse a write without the server's bearer token, when the server has one."""
    if settings.token is None:
        return
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented:
        raise HTTPException(
            401,
            "this dashboard requires a token: send 'Authorization: Bearer <token>' "
            "(ranks read it from SHARDWISE_DASHBOARD_TOKEN)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not secrets.compare_digest(presented.encode(), settings.token.encode()):
        raise HTTPException(403, "wrong dashboard token", headers={"WWW-Authenticate": "Bearer"})


TokenDep = Depends(require_token)
