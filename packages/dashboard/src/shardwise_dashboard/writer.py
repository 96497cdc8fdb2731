"""Group commit: one thread writes every batch waiting at that moment in one transaction.

A POST hands its validated batch to `BatchWriter.write` and waits for the commit that holds
it, so an acknowledged event survives a restart just as before; but when a thousand ranks post
at once, their batches share a transaction (and its commit), instead of queueing one by one
behind the store's lock. The same thread runs the retention pass between groups, so pruning
never races a write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from shardwise_dashboard.storage import RunStore, event_bodies

_STOP = object()
_log = logging.getLogger("shardwise_dashboard")

Batch = Sequence[dict[str, Any]]


class BatchWriter:
    """Writes batches of events to `store` from one background thread, grouping them.

    Args:
        store: where the events go.
        max_group_events: most events in one transaction (a bound on how long the store's
            lock is held while readers wait).
        maintenance: run between groups at most every `maintenance_interval_s` seconds
            (retention); None for none.
        maintenance_interval_s: see above.
    """

    def __init__(
        self,
        store: RunStore,
        *,
        max_group_events: int = 50_000,
        maintenance: Callable[[], object] | None = None,
        maintenance_interval_s: float = 60.0,
    ) -> None:
        self.store = store
        self.max_group_events = max_group_events
        self.maintenance = maintenance
        self.maintenance_interval_s = maintenance_interval_s
        self.commits = 0
        self.batches = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dashboard-writer", daemon=True)
        self._thread.start()

    async def write(self, events: Batch, bodies: Sequence[str] | None = None) -> None:
        """Store `events` (with their JSON `bodies` when already made) and return once they
        are committed (raises what the store raised: `StoreBusy` when another process holds
        the lock)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        texts = bodies if bodies is not None else event_bodies(events)
        self._queue.put((events, texts, loop, done))
        await done

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        next_maintenance = time.monotonic() + self.maintenance_interval_s
        while True:
            wait = max(0.0, next_maintenance - time.monotonic())
            try:
                item = self._queue.get(timeout=wait if self.maintenance else None)
            except queue.Empty:
                item = None
            group = []
            stop = item is _STOP
            if item is not None and not stop:
                group.append(item)
                size = len(item[0])
                while size < self.max_group_events:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is _STOP:
                        stop = True
                        break
                    group.append(item)
                    size += len(item[0])
            if group:
                self._commit(group)
            if self.maintenance and time.monotonic() >= next_maintenance:
                next_maintenance = time.monotonic() + self.maintenance_interval_s
                try:
                    self.maintenance()
                except Exception:
                    # Retention failing must not stop ingestion; it is tried again next time.
                    _log.exception("dashboard retention pass failed")
            if stop:
                return

    def _commit(
        self, group: list[tuple[Batch, Sequence[str], asyncio.AbstractEventLoop, Any]]
    ) -> None:
        error: BaseException | None = None
        try:
            self.store.add_batches(
                [events for events, _, _, _ in group], [texts for _, texts, _, _ in group]
            )
            self.commits += 1
            self.batches += len(group)
        except Exception as failure:
            error = failure
        for _, _, loop, done in group:
            # RuntimeError: that request's event loop is gone (the server is shutting down).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, done, error)


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():  # the client went away and the request was cancelled
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
