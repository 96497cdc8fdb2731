"""Telemetry: events per step and chunk snapshots, and an emitter that never holds training up."""

from __future__ import annotations

import io
import json
import socket
import sys
import time
import urllib.error
from email.message import Message
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, OkResponse, batch_slice, make_model

from shardwise import telemetry, zero_model_wrapper, zero_optim_wrapper
from shardwise.telemetry import HttpSink, TelemetryEmitter, sinks
from shardwise.testing import run_ranks


def _train(sink: dict[str, str], steps: int) -> dict[str, Any]:
    rank = dist.get_rank()
    model = make_model()
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL}
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    recorder = telemetry.enable(wrapped, optimizer, run_id="test-run", chunk_every=3, **sink)
    assert recorder is not None
    losses, sent, evals = [], [], []
    # A step event counts the bytes sent since the previous one: an evaluation's included.
    before = wrapped.comm_stats.sent_bytes()
    for step in range(steps):
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, 2))
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss.detach()))
        sent.append(wrapped.comm_stats.sent_bytes() - before)
        before = wrapped.comm_stats.sent_bytes()
        if step % 2 == 1:
            # An evaluation on a batch no step trains on; every rank runs its share.
            with torch.no_grad():
                held_out = wrapped(*batch_slice(100 + step, 0, rank, 2))
            recorder.evaluated(step, held_out)  # a tensor is taken as its value
            evals.append(float(held_out))
    recorder.evaluated(steps - 1, float("nan"))  # not finite: reported as unknown
    refused = []
    for bad in (-1, True, 1.0):
        try:
            recorder.evaluated(bad, 1.0)  # type: ignore[arg-type]
        except ValueError as error:
            refused.append(str(error))
    recorder.finish()
    return {
        "losses": losses,
        "sent": sent,
        "evals": evals,
        "refused": refused,
        "chunks": len(wrapped.chunk_manager.chunks),
        "dropped": recorder.emitter.dropped,
        "cpu_seconds": recorder.cpu_seconds(),
    }


def test_jsonl_events_describe_every_step(tmp_path: Path) -> None:
    path = str(tmp_path / "telemetry")
    results = run_ranks(_train, 2, {"path": path}, 5)
    for rank, result in enumerate(results):
        lines = (tmp_path / f"telemetry.rank{rank}.jsonl").read_text().splitlines()
        events = [json.loads(line) for line in lines]
        assert all(
            e["schema"] == 1 and e["run_id"] == "test-run" and e["rank"] == rank for e in events
        )
        kinds = [e["type"] for e in events]
        assert kinds[0] == "run_started" and kinds[-1] == "run_finished"
        steps = [e for e in events if e["type"] == "step"]
        assert [e["step"] for e in steps] == list(range(5))
        assert [e["loss"] for e in steps] == result["losses"]
        assert [sum(e["comm_bytes"].values()) for e in steps] == result["sent"]
        assert all(e["memory"]["device"] > 0 and e["loss_scale"] == 1.0 for e in steps)
        snapshots = [e for e in events if e["type"] == "chunks"]
        assert [e["step"] for e in snapshots] == [0, 3]
        assert all(len(e["chunks"]) == result["chunks"] for e in snapshots)
        # Evaluations after steps 1 and 3, each after its step's event, then the non-finite one.
        evals = [e for e in events if e["type"] == "eval"]
        assert [(e["step"], e["loss"]) for e in evals] == [
            (1, result["evals"][0]),
            (3, result["evals"][1]),
            (4, None),
        ]
        assert all(
            set(e) == {"schema", "type", "run_id", "rank", "time", "step", "loss"} for e in evals
        )
        order = [(e["type"], e["step"]) for e in events if e["type"] in ("step", "eval")]
        assert order.index(("eval", 1)) == order.index(("step", 1)) + 1
        assert result["refused"] == [
            "step must be an int >= 0, got -1",
            "step must be an int >= 0, got True",
            "step must be an int >= 0, got 1.0",
        ]
        assert events[-1]["status"] == "finished"
        # What telemetry cost this rank is measured (benchmarks report it per step).
        assert 0.0 < result["cpu_seconds"] < 5.0


def _unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_dashboard_that_is_down_does_not_stop_training() -> None:
    url = f"http://127.0.0.1:{_unused_port()}"
    results = run_ranks(_train, 2, {"url": url}, 3)
    for result in results:
        assert len(result["losses"]) == 3
        assert result["dropped"] > 0  # counted, and reported once at the end


class _SlowSink:
    def __init__(self) -> None:
        self.batches: list[list[dict[str, Any]]] = []

    def write(self, events: list[dict[str, Any]]) -> None:
        time.sleep(0.2)
        self.batches.append(events)

    def close(self) -> None:
        pass


def test_emit_never_waits_for_a_slow_sink() -> None:
    sink = _SlowSink()
    emitter = TelemetryEmitter(sink, run_id="r", rank=0, queue_size=100, batch_size=10)
    start = time.perf_counter()
    for i in range(5000):
        emitter.emit({"type": "step", "step": i})
    assert time.perf_counter() - start < 0.5
    emitter.close(timeout_s=0.5)
    delivered = sum(len(batch) for batch in sink.batches)
    assert emitter.dropped >= 5000 - 100 - 10
    assert delivered + emitter.dropped <= 5000 + 1
    assert sink.batches[-1][-1]["type"] in ("dropped", "step")


def test_nothing_configured_means_nothing_happens(monkeypatch: Any) -> None:
    monkeypatch.delenv("SHARDWISE_DASHBOARD_URL", raising=False)
    monkeypatch.delenv("SHARDWISE_TELEMETRY_FILE", raising=False)

    def check() -> bool:
        model = make_model()
        wrapped = zero_model_wrapper(model, 2, {"device": torch.device("cpu")})
        optimizer = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
        return telemetry.enable(wrapped, optimizer) is None

    assert run_ranks(check, 1) == [True]


class _DeadSink:
    def __init__(self) -> None:
        self.calls = 0

    def write(self, events: list[dict[str, Any]]) -> None:
        self.calls += 1
        raise ConnectionRefusedError("the dashboard is gone")

    def close(self) -> None:
        pass


def test_undelivered_events_are_counted_and_reported_once(caplog: Any) -> None:
    sink = _DeadSink()
    emitter = TelemetryEmitter(sink, run_id="r", rank=3, queue_size=100, batch_size=10)
    for i in range(25):
        emitter.emit({"type": "step", "step": i})
    with caplog.at_level("WARNING", logger="shardwise.telemetry"):
        emitter.close(timeout_s=2.0)
        emitter.close(timeout_s=2.0)  # closing twice reports nothing more
    assert emitter.dropped == 25 and emitter.delivered == 0
    (record,) = caplog.records
    assert "run r, rank 3: 25 events could not be delivered" in record.getMessage()
    assert sink.calls >= 3 + 1  # the batches, then the "dropped" event, all refused


def _crash_after_one_step(path: str) -> None:
    model = make_model()
    wrapped = zero_model_wrapper(model, 2, {"device": torch.device("cpu")})
    optimizer = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    recorder = telemetry.enable(wrapped, optimizer, path=path, run_id="crash")
    assert recorder is not None
    optimizer.backward(wrapped(*batch_slice(0, 0, 0, 1)))
    optimizer.step()
    # What the interpreter does with an exception nobody caught, before the atexit handlers.
    sys.excepthook(RuntimeError, RuntimeError("out of memory on step 1"), None)


def test_an_uncaught_exception_reports_the_run_failed(tmp_path: Path) -> None:
    run_ranks(_crash_after_one_step, 1, str(tmp_path / "telemetry"))
    lines = (tmp_path / "telemetry.rank0.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["type"] for e in events] == ["run_started", "step", "chunks", "run_finished"]
    assert events[-1]["status"] == "failed"
    assert events[-1]["error"] == "RuntimeError: out of memory on step 1"


def test_the_http_sink_splits_a_batch_over_its_body_limit(monkeypatch: Any) -> None:
    bodies: list[bytes] = []

    def urlopen(request: Any, timeout: float) -> OkResponse:
        bodies.append(request.data)
        return OkResponse()

    monkeypatch.setattr(sinks.urllib.request, "urlopen", urlopen)
    events = [{"type": "step", "step": i, "pad": "x" * 100} for i in range(100)]
    HttpSink("http://127.0.0.1:1", max_body_bytes=2048).write(events)
    assert all(len(body) <= 2048 for body in bodies) and len(bodies) >= 6
    sent = [e for body in bodies for e in json.loads(body)["events"]]
    assert sent == events  # all of them, once, in order


class _OldDashboard:
    """urlopen as against a dashboard from before "eval" events: a batch holding one is refused
    whole, each such event named by its index, as pydantic names an unknown tag."""

    def __init__(self) -> None:
        self.stored: list[dict[str, Any]] = []
        self.requests = 0

    def __call__(self, request: Any, timeout: float) -> Any:
        self.requests += 1
        events = json.loads(request.data)["events"]
        detail = [
            {"loc": ["body", "events", i], "msg": "no such tag", "type": "union_tag_invalid"}
            for i, e in enumerate(events)
            if e["type"] not in ("run_started", "step", "chunks", "run_finished", "dropped")
        ] + [
            {"loc": ["body", "events", i, "step"], "msg": "not an int", "type": "int_type"}
            for i, e in enumerate(events)
            if not isinstance(e["step"], int)
        ]
        if detail:
            body = io.BytesIO(json.dumps({"detail": detail}).encode())
            raise urllib.error.HTTPError(request.full_url, 422, "Unprocessable", Message(), body)
        self.stored += events
        return OkResponse()


def test_a_dashboard_from_before_eval_events_still_gets_the_others(
    monkeypatch: Any, caplog: Any
) -> None:
    old = _OldDashboard()
    monkeypatch.setattr(sinks.urllib.request, "urlopen", old)
    sink = HttpSink("http://127.0.0.1:1", share_node=False)
    steps = [{"type": "step", "step": i} for i in range(4)]
    evaluation = {"type": "eval", "step": 1, "loss": 2.5}
    with caplog.at_level("WARNING", logger="shardwise.telemetry"):
        sink.write([steps[0], steps[1], evaluation, steps[2]])
        sink.write([evaluation, steps[3], {**evaluation, "step": 3}])
        sink.write([evaluation])
    assert old.stored == steps  # every step, once, in order; no evaluation
    assert sink.refused_types == {"eval"}
    assert old.requests == 3  # refused once; later batches are sent without asking again
    (record,) = caplog.records
    assert "does not know 'eval' events" in record.getMessage()
    # A 422 for anything else is still an error the emitter counts.
    with pytest.raises(urllib.error.HTTPError):
        sink.write([{"type": "step", "step": "4"}, evaluation])
    assert sink.refused_types == {"eval"} and old.stored == steps


def _hybrid_run_header(path: str) -> None:
    model = make_model()
    config = {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL, "shard_size": 2}
    wrapped = zero_model_wrapper(model, 3, config)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    recorder = telemetry.enable(wrapped, optimizer, run_id="hybrid", path=path)
    assert recorder is not None
    optimizer.zero_grad()
    optimizer.backward(wrapped(*batch_slice(0, 0, dist.get_rank(), 4)))
    optimizer.step()
    recorder.finish()


def test_the_run_header_names_the_shard_groups(tmp_path: Path) -> None:
    run_ranks(_hybrid_run_header, 4, str(tmp_path / "telemetry"))
    for rank in range(4):
        lines = (tmp_path / f"telemetry.rank{rank}.jsonl").read_text().splitlines()
        events = [json.loads(line) for line in lines]
        assert events[0]["config"]["shard_size"] == 2 and events[0]["config"]["replicas"] == 2
        # What chose the chunk size travels with the header too.
        assert events[0]["config"]["chunk_size"] == f"chunk_size_numel {CHUNK_NUMEL} as set"
        step = next(e for e in events if e["type"] == "step")
        # The only bytes crossing the groups, counted apart (see tests/test_hybrid_sharding.py).
        assert step["comm_bytes"]["replicate_all_reduce"] > 0


def _off_and_quantized(path: str) -> dict[str, Any]:
    """The same 3 stage-3 steps, off and with int8 gathers and reductions (blocks of 64),
    each streaming to its own JSON-lines file; what the counters said per step."""
    rank = dist.get_rank()
    per_step: dict[str, Any] = {}
    for name, wire in (("off", {}), ("int8", {"gather_format": "int8", "reduce_format": "int8"})):
        model = make_model()
        config = {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL, **wire}
        wrapped = zero_model_wrapper(model, 3, {**config, "quant_block_numel": 64})
        optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
        recorder = telemetry.enable(wrapped, optimizer, run_id=name, path=f"{path}.{name}")
        assert recorder is not None
        stats = wrapped.comm_stats
        totals = []
        for step in range(3):
            before = (stats.sent_bytes(), stats.unquantized_sent_bytes())
            optimizer.zero_grad()
            optimizer.backward(wrapped(*batch_slice(step, 0, rank, 2)))
            optimizer.step()
            after = (stats.sent_bytes(), stats.unquantized_sent_bytes())
            totals.append([after[0] - before[0], after[1] - before[1]])
        recorder.finish()
        per_step[name] = totals
    return per_step


def test_a_step_reports_its_bytes_against_the_unquantized_figure(tmp_path: Path) -> None:
    """`comm_bytes_unquantized` is what the same step sends with the formats off: the
    quantized run's figure equals the off run's bytes sent, kind by kind and step by step (the
    engine computes it from chunk sizes and dtypes, it does not estimate it); off, it is
    `comm_bytes` itself. The run header names the formats."""
    path = str(tmp_path / "telemetry")
    results = run_ranks(_off_and_quantized, 2, path)
    for rank, counted in enumerate(results):
        runs = {}
        for name in ("off", "int8"):
            lines = (tmp_path / f"telemetry.{name}.rank{rank}.jsonl").read_text().splitlines()
            events = [json.loads(line) for line in lines]
            runs[name] = [e for e in events if e["type"] == "step"]
            header = events[0]["config"]
            if name == "int8":
                assert (
                    header["gather_format"],
                    header["reduce_format"],
                    header["quant_block_numel"],
                ) == ("int8", "int8", 64)
            else:
                assert "gather_format" not in header
        off, quantized = runs["off"], runs["int8"]
        assert len(off) == len(quantized) == 3
        for step, (plain, ours) in enumerate(zip(off, quantized, strict=True)):
            assert plain["comm_bytes_unquantized"] == plain["comm_bytes"]
            assert ours["comm_bytes_unquantized"] == plain["comm_bytes"], step
            # What the counters said around the step (the events' intervals are the steps).
            sent, unquantized = counted["int8"][step]
            assert sum(ours["comm_bytes"].values()) == sent
            assert sum(ours["comm_bytes_unquantized"].values()) == unquantized
            # One byte a value and an fp32 scale per 64 against fp32's four bytes.
            for op in ("all_gather", "reduce_scatter"):
                ratio = ours["comm_bytes"][op] / ours["comm_bytes_unquantized"][op]
                assert ratio == pytest.approx((1 + 4 / 64) / 4, abs=0.01), (op, ratio)
        assert counted["off"][0][0] == counted["off"][0][1]
