"""Telemetry of a training run: one call turns it on, every optimizer step reports.

    recorder = shardwise.telemetry.enable(model, optimizer)   # None when nothing is configured

With no argument it reads SHARDWISE_DASHBOARD_URL (and SHARDWISE_DASHBOARD_TOKEN) or
SHARDWISE_TELEMETRY_FILE (a JSON-lines file per rank: `{path}.rank{r}.jsonl`); with neither set it
returns None and costs nothing. SHARDWISE_RUN_NAME names the run on the dashboard and
SHARDWISE_RUN_ID sets its id (else rank 0 picks one from the time); rank 0 prints the run's id
and where it goes (the run's page on the dashboard) when it starts. Each step adds one event to
a bounded queue (see TelemetryEmitter); chunk snapshots go out at the first step and every
`chunk_every` steps;
`recorder.evaluated(step, loss)` reports an evaluation (the training loop calls it: only it knows
when it evaluates). The run is reported finished by `finish()`, when its model and optimizer are
dropped, or at exit, and failed (with the exception) when an uncaught exception ends the process,
so a crashed rank shows as failed, not as finished.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

from shardwise import comm
from shardwise.engine.model import ZeroModel
from shardwise.engine.optimizer import ZeroOptimizer
from shardwise.telemetry import events
from shardwise.telemetry.destination import (
    announce,
    dashboard_url,
    run_page,
    said_unreachable,
    started_by,
)
from shardwise.telemetry.emitter import TelemetryEmitter
from shardwise.telemetry.sinks import HttpSink, JsonlSink, Sink


class TelemetryRecorder:
    """Turns optimizer steps into events on an emitter.

    Args:
        model, optimizer: the wrapped pair.
        emitter: where events go.
        chunk_every: steps between chunk snapshots.
    """

    def __init__(
        self,
        model: ZeroModel,
        optimizer: ZeroOptimizer,
        emitter: TelemetryEmitter,
        *,
        chunk_every: int = 10,
    ) -> None:
        if chunk_every < 1:
            raise ValueError(f"chunk_every must be >= 1, got {chunk_every}")
        self.model = model
        self.optimizer = optimizer
        self.emitter = emitter
        self.chunk_every = chunk_every
        self._last_time = time.perf_counter()
        self._last_sent = model.comm_stats.snapshot()
        self._last_moved = self._moved()
        self._end = _RunEnd(emitter)
        self._hook_seconds = 0.0
        optimizer.add_step_hook(self._on_step)

    def started(
        self, config: dict[str, Any], *, run_name: str | None = None, entry_point: str | None = None
    ) -> None:
        self.emitter.emit(
            events.run_started(
                self.emitter.run_id,
                self.emitter.rank,
                world_size=comm.world_size(self.model.config.topology.process_group),
                config=config,
                num_params=sum(c.numel for c in self.model.chunk_manager.chunks),
                host=socket.gethostname(),
                run_name=run_name,
                entry_point=entry_point,
                script=sys.argv[0] if sys.argv and sys.argv[0] else None,
            )
        )

    def evaluated(self, step: int, loss: float) -> None:
        """Report an evaluation's loss (an "eval" event): queued, as every event is, so it
        never waits for the dashboard.

        Args:
            step: the index of the optimizer step the evaluation followed (the first step is
                0, as in the step events).
            loss: the evaluation loss (a float or a one-element tensor); a non-finite one is
                reported as unknown.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self.emitter.emit(
            events.evaluation(
                self.emitter.run_id, self.emitter.rank, step_index=step, loss=float(loss)
            )
        )

    def _moved(self) -> dict[str, int]:
        gemini = self.model.gemini_manager
        if gemini is not None:
            return gemini.bytes_moved()
        return {"to_device": 0, "to_host": 0, "to_disk": 0, "from_disk": 0}

    def _memory(self) -> dict[str, int]:
        gemini = self.model.gemini_manager
        if gemini is not None:
            return gemini.memory_by_pool()
        device = sum(self.model.memory_report().values()) + self.optimizer.state_bytes()
        return {"device": device, "host": 0, "disk": 0}

    def cpu_seconds(self) -> float:
        """CPU time telemetry has cost this rank so far: the step hook on the training thread
        plus the delivery thread."""
        return self._hook_seconds + self.emitter.cpu_seconds

    def _on_step(self, optimizer: ZeroOptimizer) -> None:
        now = time.perf_counter()
        self._record(optimizer, now)
        self._hook_seconds += time.perf_counter() - now

    def _record(self, optimizer: ZeroOptimizer, now: float) -> None:
        sent = self.model.comm_stats.snapshot()
        moved = self._moved()
        index = optimizer.num_steps - 1
        # The sum of the step's micro-batch losses (see ZeroOptimizer.add_loss).
        loss = float(optimizer.step_loss) if optimizer.step_loss is not None else None
        self.emitter.emit(
            events.step(
                self.emitter.run_id,
                self.emitter.rank,
                step_index=index,
                loss=loss,
                loss_scale=optimizer.last_loss_scale,
                overflow=optimizer.last_step_skipped,
                grad_norm=optimizer.last_grad_norm,
                step_time_s=now - self._last_time,
                comm_bytes=_delta(sent, self._last_sent, "sent_bytes"),
                # What the same collectives would have sent unquantized (see [Note:
                # unquantized bytes] in comm/stats.py).
                comm_bytes_unquantized=_delta(sent, self._last_sent, "unquantized_sent_bytes"),
                moved_bytes={k: moved[k] - self._last_moved[k] for k in moved},
                memory=self._memory(),
                skipped_in_a_row=optimizer.skipped_in_a_row,
                warning=optimizer.skip_warning,
            )
        )
        if index % self.chunk_every == 0:
            self.emitter.emit(
                events.chunks(
                    self.emitter.run_id,
                    self.emitter.rank,
                    step_index=index,
                    report=self.model.chunk_manager.report(),
                )
            )
        self._last_time, self._last_sent, self._last_moved = now, sent, moved

    def finish(self, error: str | None = None) -> None:
        """Report the end of the run and deliver what is queued."""
        self._end(error)


class _RunEnd:
    """Reports a run's end once, whichever comes first: `finish()`, an uncaught exception, the
    recorder collected with its model and optimizer, or the interpreter's exit. It holds only
    the emitter, so what waits for the end (the exit handler, sys.excepthook) keeps no model
    alive (see [Note: hooks hold the engine weakly] in runtime/grad_reducer.py)."""

    def __init__(self, emitter: TelemetryEmitter) -> None:
        self.emitter = emitter
        self.done = False

    def __call__(self, error: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.emitter.emit(events.run_finished(self.emitter.run_id, self.emitter.rank, error=error))
        self.emitter.close()


def enable(
    model: ZeroModel,
    optimizer: ZeroOptimizer,
    *,
    url: str | None = None,
    path: str | None = None,
    token: str | None = None,
    run_id: str | None = None,
    run_name: str | None = None,
    entry_point: str = "shardwise.telemetry.enable",
    chunk_every: int = 10,
) -> TelemetryRecorder | None:
    """Stream this rank's telemetry to a dashboard (`url`) or a JSON-lines file (`path`), or
    as the environment says (see the module note). A collective when the run id is chosen
    here (rank 0's is shared). Returns None, having done nothing, when nothing is configured.
    `run_name` (else SHARDWISE_RUN_NAME) names the run on the dashboard, beside the front door
    that started it (`entry_point`) and the script; rank 0 prints the run's id and its page.

    One recorder per optimizer: every front door (`zero_optim_wrapper`, the Booster's ZeRO
    plugins, the Lightning strategies, the Trainer callback) calls this with no destination
    as it wraps the optimizer, so the environment alone streams any run. Called again for the
    same optimizer, it returns that recorder (taking `chunk_every`); naming a destination
    then is refused, since the run already streams to one."""
    existing_ref = _RECORDER_OF.get(optimizer)
    existing = existing_ref() if existing_ref is not None else None
    if existing is not None and not existing._end.done:
        if url or path or token or run_id or run_name:
            raise ValueError(
                f"telemetry already streams this optimizer's run to {existing.emitter.sink!r} "
                f"(started as it was wrapped, from SHARDWISE_DASHBOARD_URL or "
                f"SHARDWISE_TELEMETRY_FILE): call enable() without url, path, token, run_id or "
                f"run_name to get that recorder, or unset the variables to choose the "
                f"destination here (SHARDWISE_RUN_ID and SHARDWISE_RUN_NAME name the run)"
            )
        if chunk_every < 1:
            raise ValueError(f"chunk_every must be >= 1, got {chunk_every}")
        existing.chunk_every = chunk_every
        return existing
    url = url or os.environ.get("SHARDWISE_DASHBOARD_URL")
    path = path or os.environ.get("SHARDWISE_TELEMETRY_FILE")
    if not url and not path:
        return None
    rank = comm.rank(model.config.topology.process_group)
    if url:
        # Not a URL: said on rank 0, and no telemetry (unless a file is named too).
        url = dashboard_url(url, speak=rank == 0)
        if url is None and not path:
            return None
    run_id = run_id or os.environ.get("SHARDWISE_RUN_ID") or _shared_run_id(model)
    sink: Sink
    check: Callable[[], bool] | None = None
    if url:
        http = sink = HttpSink(url, token or os.environ.get("SHARDWISE_DASHBOARD_TOKEN"))
        if rank == 0:  # asked on the delivery thread: a dashboard that is down costs no step
            check = functools.partial(said_unreachable, http, url)
    else:
        sink = JsonlSink(f"{path}.rank{rank}.jsonl")
    emitter = TelemetryEmitter(sink, run_id=run_id, rank=rank, check=check)
    recorder = TelemetryRecorder(model, optimizer, emitter, chunk_every=chunk_every)
    config: dict[str, Any] = {
        "stage": model.stage,
        "chunks": len(model.chunk_manager.chunks),
        "chunk_size": model.chunk_manager.chunk_size_reason,
        "placement": model.gemini_manager.placement_policy if model.gemini_manager else None,
        "param_dtype": str(model.config.precision.param_dtype),
    }
    topology = model.chunk_manager.topology
    if topology.hybrid:  # the dashboard's run header lists every key
        config["shard_size"] = comm.world_size(topology.shard)
        config["replicas"] = topology.replicas
    if topology.secondary is not None:
        config["secondary_shard_size"] = comm.world_size(topology.secondary)
    wire = model.config.communication
    if wire.quantizes:
        config["gather_format"] = wire.gather
        config["reduce_format"] = wire.reduce
        config["quant_block_numel"] = wire.block_numel
    run_name = run_name or os.environ.get("SHARDWISE_RUN_NAME") or None
    entry_point = started_by(entry_point)
    recorder.started(config, run_name=run_name, entry_point=entry_point)
    if rank == 0:
        where = run_page(url, run_id) if url else f"{path}.rank*.jsonl"
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        said = ", ".join(f for f in (repr(run_name) if run_name else "", entry_point, script) if f)
        announce(f"telemetry of run {run_id} ({said}) goes to {where}")
    _RECORDER_OF[optimizer] = weakref.ref(recorder)
    # Called when the recorder is collected, or at exit if it lives that long.
    weakref.finalize(recorder, recorder._end)
    _report_uncaught_exceptions(weakref.ref(recorder._end))
    return recorder


# The recorder streaming each optimizer's run (weakly both ways: the recorder holds its
# optimizer, and lives as long as the optimizer's step hook holds it).
_RECORDER_OF: weakref.WeakKeyDictionary[ZeroOptimizer, weakref.ref[TelemetryRecorder]] = (
    weakref.WeakKeyDictionary()
)


def _delta(
    now: dict[str, dict[str, int]], before: dict[str, dict[str, int]], key: str
) -> dict[str, int]:
    """Per collective kind, `key`'s growth between two `CommStats.snapshot()`s."""
    return {op: now[op][key] - before[op][key] for op in now}


def _report_uncaught_exceptions(end: weakref.ref[_RunEnd]) -> None:
    # An uncaught exception runs sys.excepthook before the exit handlers: report the run
    # failed there (unless it ended already), then let the previous hook print the traceback.
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        report = end()
        if report is not None:
            report(error=f"{kind.__name__}: {value}")
        previous(kind, value, tb)

    sys.excepthook = hook


def _shared_run_id(model: ZeroModel) -> str:
    chosen = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    return str(comm.broadcast_object(chosen, model.comm_stats, model.config.topology.process_group))
