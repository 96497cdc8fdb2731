"""The page: static HTML, JavaScript and CSS shipped inside the package (no CDN, no build)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

router = APIRouter(tags=["page"])

# The page loads only its own files: nothing from elsewhere, no inline script.
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def static_files() -> StaticFiles:
    """The page's assets, served from the installed package."""
    return StaticFiles(packages=[("shardwise_dashboard", "static")])


@router.get("/", response_class=HTMLResponse)
async def index() -> HTMLResponse:
    """The dashboard page."""
    html = files("shardwise_dashboard").joinpath("static", "index.html").read_text("utf-8")
    return HTMLResponse(html, headers=_SECURITY_HEADERS)
