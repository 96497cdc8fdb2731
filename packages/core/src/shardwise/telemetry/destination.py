"""Where a run's telemetry goes and who started it, said once when it starts: rank 0 prints the
run's id and its page on the dashboard (or its files); the front door that started the run is
named in its run_started event."""

from __future__ import annotations

import contextvars
import sys
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager

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
