"""A per-rank emitter: a bounded queue drained by a background thread into a sink.

Training only ever puts events on the queue without waiting. When the queue is full (the sink
is slow, down, or the dashboard was never started) the event is dropped and counted; the count
is reported once when the emitter closes: as a "dropped" event to the sink (if it is still
there) and as a warning in this rank's log (which holds even when the sink is gone), unless the
emitter's start-up `check` said already that the sink does not answer (then the count is
logged at INFO: said once, at the start).

The thread sends at most one batch per `flush_interval_s` (sooner when `batch_size` events are
waiting, at once when closing): a rank stepping ten times a second makes one request a second,
not ten, which is what lets one dashboard follow a thousand ranks. Ranks step together, so
they would also flush together: each node waits its own fraction (one half to all) of the
interval, the same for all of its ranks (they share a sender, see sinks.py), so a thousand
ranks' batches reach the dashboard spread over half an interval rather than at one instant.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from shardwise.telemetry import events
from shardwise.telemetry.sinks import Sink

_STOP = object()
_log = logging.getLogger("shardwise.telemetry")


class TelemetryEmitter:
    """Non-blocking event delivery for one rank.

    Args:
        sink: where batches go.
        run_id: the run the events belong to.
        rank: this rank.
        queue_size: events held before new ones are dropped.
        batch_size: most events sent in one write.
        flush_interval_s: longest an event waits for others to share its write (0: send
            whatever is queued at once).
        check: run once on the delivery thread before the first write (rank 0's check that
            the dashboard answers); returns True when it warned that the sink does not.
    """

    def __init__(
        self,
        sink: Sink,
        *,
        run_id: str,
        rank: int,
        queue_size: int = 10_000,
        batch_size: int = 200,
        flush_interval_s: float = 0.5,
        check: Callable[[], bool] | None = None,
    ) -> None:
        if queue_size < 1 or batch_size < 1:
            raise ValueError(
                f"queue_size and batch_size must be >= 1, got {queue_size}, {batch_size}"
            )
        if not 0 <= flush_interval_s <= 60:
            raise ValueError(f"flush_interval_s must be in [0, 60], got {flush_interval_s}")
        self.flush_interval_s = flush_interval_s
        # This node's share of the interval, in [0.5, 1): the same for its ranks, spread
        # across nodes (see the module note).
        node = zlib.crc32(socket.gethostname().encode()) % 1000
        self._flush_wait_s = flush_interval_s * (0.5 + node / 2000)
        self.sink = sink
        self.run_id = run_id
        self.rank = rank
        self.batch_size = batch_size
        self.dropped = 0
        self.delivered = 0
        # CPU seconds the delivery thread has used: what telemetry takes from training on a
        # host whose cores are all busy (benchmarks report it per step).
        self.cpu_seconds = 0.0
        self._check = check
        self.said_unreachable = False  # the check warned that the sink does not answer
        self.checked = threading.Event()  # set once the check ran (at once without one)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._drain, name="shardwise-telemetry", daemon=True)
        self._thread.start()
        self._closed = False

    def emit(self, event: dict[str, Any]) -> None:
        """Queue `event`; never blocks, never raises."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued (waiting at most `timeout_s`), report drops, stop the thread."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=timeout_s)
        self._thread.join(timeout_s)
        if self.dropped:
            _log.log(
                logging.INFO if self.said_unreachable else logging.WARNING,
                "telemetry of run %s, rank %d: %d events could not be delivered to %s "
                "(%d were); training was not slowed",
                self.run_id,
                self.rank,
                self.dropped,
                self.sink,
                self.delivered,
            )
            # If the sink is gone there is nobody left to tell but the log.
            with contextlib.suppress(Exception):
                self.sink.write([events.dropped(self.run_id, self.rank, self.dropped)])
        self.sink.close()

    def _drain(self) -> None:
        if self._check is not None:
            try:
                self.said_unreachable = self._check()
            except Exception:  # a check that failed says nothing; delivery goes on
                _log.debug("telemetry start-up check failed", exc_info=True)
        self.checked.set()
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            stop = False
            deadline = time.monotonic() + self._flush_wait_s
            while len(batch) < self.batch_size:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
            try:
                self.sink.write(batch)
                self.delivered += len(batch)
            except Exception:
                # A dashboard that is down or slow loses these events, never the run.
                self.dropped += len(batch)
            self.cpu_seconds = time.thread_time()
            if stop:
                return
