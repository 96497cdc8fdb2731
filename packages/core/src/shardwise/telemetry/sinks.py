"""Where telemetry goes: a JSON-lines file, or a dashboard over HTTP.

See [Note: one sender per node] in telemetry/node_relay.py for how the ranks of a node share
one sender.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from shardwise.telemetry.node_relay import NodeRelay, RelayPeer, node_sharing_wanted, relay_address

_log = logging.getLogger("shardwise.telemetry")


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
    """POSTs batches to a dashboard's ingestion endpoint, through the node's shared sender
    when there is one (see [Note: one sender per node]). A dashboard that refuses a batch for
    an event type it does not know (a release from before that type) gets the batch's other
    events, and none of that type from then on (`refused_types`).

    Args:
        url: the dashboard's base URL, e.g. http://127.0.0.1:8265.
        token: sent as a bearer token when the dashboard requires one.
        timeout_s: per request; a slow dashboard costs the emitter thread, never training.
        max_body_bytes: a batch whose JSON is larger goes in several requests (the dashboard
            refuses bodies over 8 MiB by default; big chunk snapshots add up).
        compress_min_bytes: bodies at least this large are sent gzipped.
        share_node: share one sender among the node's ranks; None: when torchrun's
            LOCAL_RANK / LOCAL_WORLD_SIZE say there are several and
            SHARDWISE_TELEMETRY_SHARE_NODE is not "0".
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 2.0,
        max_body_bytes: int = 4 * 2**20,
        compress_min_bytes: int = 16 * 1024,
        share_node: bool | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"dashboard URL must start with http:// or https://, got {url!r}")
        if max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {max_body_bytes}")
        self.endpoint = url.rstrip("/") + "/api/v1/events"
        self.token = token
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self.compress_min_bytes = compress_min_bytes
        self.posts = 0  # requests this sink made itself
        self._compress = True  # off once a dashboard refuses gzip (an older release)
        # Event types the dashboard named as unknown (an older release): not sent to it again.
        self.refused_types: set[str] = set()
        self._relay: NodeRelay | None = None
        self._peer: RelayPeer | None = None
        if share_node is None:
            share_node = node_sharing_wanted()
        if share_node:
            address = relay_address(self.endpoint)
            if os.environ.get("LOCAL_RANK") == "0":
                with contextlib.suppress(OSError):  # taken: another sender serves this node
                    self._relay = NodeRelay(address, self._post)
            if self._relay is None:
                self._peer = RelayPeer(address, timeout_s=timeout_s * 4)

    def write(self, events: list[dict[str, Any]]) -> None:
        if self._relay is not None:
            self._relay.submit(events)
        elif self._peer is None or not self._peer.send(events):
            self._post(events)

    def _post(self, events: list[dict[str, Any]]) -> None:
        if self.refused_types:
            events = [e for e in events if e.get("type") not in self.refused_types]
            if not events:
                return
        body = json.dumps({"events": events}, allow_nan=False).encode()
        if len(body) > self.max_body_bytes and len(events) > 1:
            half = len(events) // 2
            self._post(events[:half])
            self._post(events[half:])
            return
        compress = self._compress and len(body) >= self.compress_min_bytes
        for attempt in range(2):
            try:
                self._request(gzip.compress(body, compresslevel=1) if compress else body, compress)
                return
            except urllib.error.HTTPError as error:
                unknown = _unknown_types(error, events) if error.code == 422 else set()
                if unknown:
                    # A dashboard from before these event types refuses the whole batch:
                    # send it the others, and never these again.
                    _log.warning(
                        "the dashboard at %s does not know %s events (an older release): "
                        "they are not sent to it",
                        self.endpoint,
                        ", ".join(map(repr, sorted(unknown))),
                    )
                    self.refused_types |= unknown
                    self._post(events)
                    return
                if compress and error.code in (400, 415, 422):
                    # A dashboard from before gzip bodies: say it plainly from now on.
                    self._compress = compress = False
                    continue
                if error.code == 503 and attempt == 0:
                    # Its database is locked for a moment: wait as asked, once, within reason.
                    time.sleep(min(float(error.headers.get("Retry-After") or 1), 5.0))
                    continue
                raise

    def check(self) -> str | None:
        """Whether the dashboard answers (one GET of its health endpoint, within `timeout_s`):
        None when it does, else what went wrong."""
        health = self.endpoint.removesuffix("/events") + "/health"
        try:
            with urllib.request.urlopen(health, timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as error:
            return f"HTTP {error.code} from {health}: is it a shardwise dashboard?"
        except (OSError, ValueError) as error:
            return str(getattr(error, "reason", None) or error)
        return None

    def _request(self, body: bytes, compressed: bool) -> None:
        request = urllib.request.Request(self.endpoint, data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        if compressed:
            request.add_header("Content-Encoding", "gzip")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        self.posts += 1
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            response.read()

    def close(self) -> None:
        if self._relay is not None:
            self._relay.close()
        if self._peer is not None:
            self._peer.close()

    def __repr__(self) -> str:
        return f"HttpSink({self.endpoint!r})"


def _unknown_types(error: urllib.error.HTTPError, events: list[dict[str, Any]]) -> set[str]:
    """The types of the events a 422 answer refused for their type alone (the dashboard
    names each such event by its index, with pydantic's "union_tag_invalid")."""
    try:
        problems = json.loads(error.read())["detail"]
        found: set[str] = set()
        for problem in problems:
            loc = problem["loc"]
            if problem["type"] == "union_tag_invalid" and loc[:2] == ["body", "events"]:
                found.add(str(events[loc[2]]["type"]))
        return found
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return set()
