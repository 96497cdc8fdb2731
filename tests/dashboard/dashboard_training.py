"""The training run the end-to-end dashboard tests stream: ZeRO stage 3 on CPU ranks."""

from __future__ import annotations

import logging
import os
import signal
import time
import urllib.request
from typing import Any

import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, make_model

from shardwise import telemetry, zero_model_wrapper, zero_optim_wrapper

CHUNK_EVERY = 5


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _wait_until_ingested(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/api/v1/health", timeout=1) as response:
            if b'"num_events":0' not in response.read():
                return
        time.sleep(0.02)
    raise AssertionError(f"no event reached {url} within {timeout_s} s")


def _evaluate(wrapped: torch.nn.Module, step: int) -> float:
    """The loss on a batch no step trains on, averaged over the ranks (each runs its share, as
    every rank must run the same passes at stage 3)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        loss = wrapped(*batch_slice(1000 + step, 0, rank, world)).detach().float()
    dist.all_reduce(loss)
    return float(loss) / world


def train(
    url: str | None,
    steps: int,
    kill_at: int = -1,
    server_pid: int = 0,
    eval_every: int = 0,
    wire: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train `steps` steps on this rank, streaming telemetry to `url` when given. With
    `kill_at`, rank 0 SIGKILLs the dashboard (`server_pid`) before that step, once the
    dashboard holds some of this run's events. With `eval_every`, every rank evaluates after
    every that many steps and reports it (`recorder.evaluated`). `wire`: gemini_config's wire
    formats (`gather_format`, ...). Per step, the bytes the engine counted as sent and as
    what it would have sent unquantized, between the ends of consecutive steps, as the step
    events count them."""
    rank = dist.get_rank()
    warnings = _Collect()
    logging.getLogger("shardwise.telemetry").addHandler(warnings)
    model = make_model()
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL, **(wire or {})}
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    recorder = None
    if url is not None:
        # As a user turns it on (this rank is a forked process: the parent is untouched).
        os.environ["SHARDWISE_DASHBOARD_URL"] = url
        recorder = telemetry.enable(wrapped, optimizer, chunk_every=CHUNK_EVERY)
        assert recorder is not None
        del os.environ["SHARDWISE_DASHBOARD_URL"]
    stats = wrapped.comm_stats
    losses, evals, wire_bytes = [], [], []
    last = (stats.sent_bytes(), stats.unquantized_sent_bytes())
    for step in range(steps):
        if rank == 0 and step == kill_at:
            assert url is not None
            _wait_until_ingested(url)
            os.kill(server_pid, signal.SIGKILL)
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, dist.get_world_size()))
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss.detach()))
        now = (stats.sent_bytes(), stats.unquantized_sent_bytes())
        wire_bytes.append([now[0] - last[0], now[1] - last[1]])
        last = now
        if eval_every and (step + 1) % eval_every == 0:
            evals.append([step, _evaluate(wrapped, step)])
            if recorder is not None:
                recorder.evaluated(*evals[-1])
    result: dict[str, Any] = {
        "losses": losses,
        "evals": evals,
        "wire_bytes": wire_bytes,
        "chunk_ids": [chunk.chunk_id for chunk in wrapped.chunk_manager.chunks],
    }
    if recorder is not None:
        recorder.finish()
        result.update(
            run_id=recorder.emitter.run_id,
            dropped=recorder.emitter.dropped,
            delivered=recorder.emitter.delivered,
            warnings=warnings.messages,
        )
    return result


def train_without_then_with_telemetry(
    url: str, steps: int, kill_at: int, server_pid: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same run twice in one process group: plain, then streaming (see `train`)."""
    return train(None, steps), train(url, steps, kill_at, server_pid)
