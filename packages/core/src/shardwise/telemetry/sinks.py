"""Where telemetry goes: a JSON-lines file, or a dashboard over HTTP."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any, Protocol


class Sink(Protocol):
    def write(self, events: list[dict[str, Any]]) -> None:
        """Deliver a batch; raise on failure (the emitter counts it as dropped)."""

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per line to `path` (one file per rank is the caller's choice)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self._file.write(json.dumps(event, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"


class HttpSink:
    """POSTs batches to a dashboard's ingestion endpoint.

    Args:
        url: the dashboard's base URL, e.g. http://127.0.0.1:8265.
        token: sent as a bearer token when the dashboard requires one.
        timeout_s: per request; a slow dashboard costs the emitter thread, never training.
        max_body_bytes: a batch whose JSON is larger goes in several requests (the dashboard
            refuses bodies over 8 MiB by default; big chunk snapshots add up).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 2.0,
        max_body_bytes: int = 4 * 2**20,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"dashboard URL must start with http:// or https://, got {url!r}")
        if max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {max_body_bytes}")
        self.endpoint = url.rstrip("/") + "/api/v1/events"
        self.token = token
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes

    def write(self, events: list[dict[str, Any]]) -> None:
        body = json.dumps({"events": events}, allow_nan=False).encode()
        if len(body) > self.max_body_bytes and len(events) > 1:
            half = len(events) // 2
            self.write(events[:half])
            self.write(events[half:])
            return
        request = urllib.request.Request(self.endpoint, data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            response.read()

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"HttpSink({self.endpoint!r})"
