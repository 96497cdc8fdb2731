"""Fan-out of freshly ingested events to every open live stream.

Each browser stream holds a bounded queue of JSON messages. Publishing never waits: a stream
whose browser falls behind loses its oldest message and is told to resynchronise (reload the
run from the history endpoints), so one slow tab can never hold ingestion up. Everything here
runs on the server's event loop: the ingest endpoint publishes from it, streams read from it.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class Subscriber:
    """One open stream: the run it follows (None: all runs) and its pending messages."""

    run_id: str | None
    queue: asyncio.Queue[str]
    lagged: bool = field(default=False)


class LiveHub:
    """Publishes batches of events to subscribers.

    Args:
        queue_size: messages a subscriber may have pending before it starts losing them.
    """

    def __init__(self, queue_size: int = 1024) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.queue_size = queue_size
        self._subscribers: set[Subscriber] = set()

    @property
    def num_subscribers(self) -> int:
        """Streams open now."""
        return len(self._subscribers)

    def subscribe(self, run_id: str | None) -> Subscriber:
        """Open a stream of the events of `run_id` (or of every run)."""
        subscriber = Subscriber(run_id, asyncio.Queue(self.queue_size))
        self._subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        """Close a stream; unknown streams are ignored."""
        self._subscribers.discard(subscriber)

    def publish(self, events: list[dict[str, Any]], bodies: list[str] | None = None) -> None:
        """Send `events` to every subscriber that follows their run, as one message per run
        (`bodies`: each event's JSON, when already made)."""
        if not self._subscribers:
            return
        texts = bodies if bodies is not None else [json.dumps(event) for event in events]
        by_run: dict[str, list[str]] = defaultdict(list)
        for event, text in zip(events, texts, strict=True):
            by_run[event["run_id"]].append(text)
        encoded = {run_id: "[" + ",".join(batch) + "]" for run_id, batch in by_run.items()}
        every_run = "[" + ",".join(texts) + "]" if len(by_run) > 1 else next(iter(encoded.values()))
        for subscriber in self._subscribers:
            if subscriber.run_id is None:
                message = every_run
            elif subscriber.run_id in encoded:
                message = encoded[subscriber.run_id]
            else:
                continue
            if subscriber.queue.full():
                subscriber.queue.get_nowait()
                subscriber.lagged = True
            subscriber.queue.put_nowait(message)
