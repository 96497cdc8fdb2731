"""The side streams of one engine and their events: gathers, reductions and copies off the
compute stream on CUDA; nothing on a CPU, where every operation runs in order anyway.

[Note: streams and events]
On CUDA a kernel queued on the default (compute) stream runs after everything queued before
it there. A copy of chunk k+1's shard from host memory, queued there, waits for chunk k's
compute, and chunk k+1's modules then wait for the copy: nothing overlaps. FSDP2 runs its
all-gathers and its copies on streams of their own, ordered against compute by events, and
so does the engine: `Streams` holds a gather stream (host->device copies of shards and their
gathers), a reduce stream and a copy stream (device->host: reduced gradients leaving for the
host step), as FSDP2's `FSDPCommContext` does.

The rules, which `start_copy` (memory/copies.py) follows for every copy between devices:
- a side stream first waits for an event recorded on the stream that produced the source, so
  it reads finished values;
- the copy's own completion is an event, carried by the `PendingCopy` it returns; the
  consumer waits for it on its own stream (device consumers: `wait_event`, no host stall) or
  on the host (host consumers: `synchronize`), never earlier than it needs the values;
- a buffer read or written on a side stream stays allocated until that event: device tensors
  through `record_stream` (the caching allocator defers their reuse), pooled pinned buffers
  through the pool's record of the copy's completion (memory/pinned.py).
On a CPU there are no streams: `start_copy` copies at once and the pending copy is done.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


class Streams:
    """The gather, reduce and copy streams of `device` (CUDA), or none (anything else).

    Args:
        device: the compute device.
        enabled: use side streams where the device has them (False: every copy and
            collective on the current stream, as before streams existed).
    """

    def __init__(self, device: torch.device, *, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self.gather: Any = None
        self.reduce: Any = None
        self.copy: Any = None
        if self.enabled:
            self.gather = torch.cuda.Stream(device)
            self.reduce = torch.cuda.Stream(device)
            self.copy = torch.cuda.Stream(device)

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """Queue what runs inside on `stream` (a no-op without streams)."""
        return torch.cuda.stream(stream) if self.enabled and stream is not None else nullcontext()

    def record(self, stream: Any = None) -> Any:
        """An event recorded now on `stream` (the current stream when None); None without
        streams."""
        if not self.enabled:
            return None
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event: Any, stream: Any = None) -> None:
        """Make `stream` (the current one when None) wait for `event` (no host stall)."""
        if event is None:
            return
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        stream.wait_event(event)

    def __repr__(self) -> str:
        return f"Streams(device={self.device}, enabled={self.enabled})"


__all__ = ["Streams"]
