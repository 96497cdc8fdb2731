"""Where a run's telemetry goes and who started it, said once when it starts: rank 0 prints the
run's id and its page on the dashboard (or its files); the front door that started the run is
named in its run_started event. A dashboard URL that is not one, or a dashboard that does not
answer, never stops or slows training: rank 0 says so once, as a warning of the
"shardwise.telemetry" logger (a log record, so that `-W error` cannot turn it into an exception
that ends the run), and the run goes on.
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

_log = logging.getLogger("shardwise.telemetry")

# What is taken for a dashboard's address without its scheme: a host, a port and a path at most
# ("127.0.0.1:8265", "dash.internal:8300/"); "htp:/host" is a mistyped scheme, not a host.
_HOST_PORT = re.compile(r"[A-Za-z0-9.\-]+(:[0-9]+)?(/.*)?|\[[0-9A-Fa-f:.]+\](:[0-9]+)?(/.*)?")

# The URLs a warning was given about: every front door of a script asks again.
_SAID: set[str] = set()

_FRONT_DOOR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "shardwise_telemetry_front_door", default=None
)


@contextmanager
def front_door(name: str) -> Iterator[None]:
    """Runs whose telemetry starts inside are said to be started by `name`, whichever front
    door inside calls `enable` (the outermost wins: the Booster's GeminiPlugin builds a
    GeminiOptimizer, a front door of its own)."""
    token = _FRONT_DOOR.set(_FRONT_DOOR.get() or name)
    try:
        yield
    finally:
        _FRONT_DOOR.reset(token)


def started_by(entry_point: str) -> str:
    """The front door a run is said to be started by: the outermost `front_door` around this
    call, else `entry_point` (the one calling `enable`)."""
    return _FRONT_DOOR.get() or entry_point


def run_page(url: str, run_id: str) -> str:
    """The dashboard's page of run `run_id` (the page opens the run named after `#run=`)."""
    return f"{url.rstrip('/')}/#run={urllib.parse.quote(run_id, safe='')}"


def announce(line: str) -> None:
    """One line to the user, on stderr (shown whatever logging is configured)."""
    print(f"shardwise: {line}", file=sys.stderr, flush=True)


def dashboard_url(url: str, *, speak: bool) -> str | None:
    """`url` as the address of a dashboard: "host:port" without a scheme is taken as
    http://host:port; anything else that is not an http:// or https:// URL with a host is
    refused, returning None (telemetry to the dashboard is off). Either is said once per
    process, as a warning, where `speak` (rank 0); nothing raises.
    """
    given = url
    speak = speak and given not in _SAID
    if speak:
        _SAID.add(given)
    url = url.strip()
    schemeless = _HOST_PORT.fullmatch(url) is not None
    if schemeless:
        url = f"http://{url}"
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # a port that is not a number raises here
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        if speak:
            _log.warning(
                "shardwise: the dashboard URL %r (SHARDWISE_DASHBOARD_URL or enable(url=...)) is "
                "not an http:// or https:// address, such as http://127.0.0.1:8265: this run "
                "streams no telemetry; training goes on",
                given,
            )
        return None
    if schemeless and speak:
        _log.warning(
            "shardwise: the dashboard URL %r has no http:// or https://: taken as %s "
            "(set SHARDWISE_DASHBOARD_URL=%s to say so)",
            given,
            url,
            url,
        )
    return url


class _Checkable(Protocol):
    def check(self) -> str | None: ...


def said_unreachable(sink: _Checkable, url: str) -> bool:
    """Ask the dashboard at `url` whether it answers (`sink.check()`); when it does not, say so
    once, as a warning, and return True (rank 0, at the start of a run)."""
    problem = sink.check()
    if problem is None:
        return False
    _log.warning(
        "shardwise: the dashboard at %s does not answer (%s): this run's telemetry will be "
        "dropped, counted, until it does; training goes on, not slowed. Start it with "
        "`shardwise-dashboard serve`, or point SHARDWISE_DASHBOARD_URL at it",
        url,
        problem,
    )
    return True
