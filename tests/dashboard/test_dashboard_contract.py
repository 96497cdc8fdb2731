"""The contract with core (same schema version, core's events accepted), the no-torch rule,
the command line's refusals, settings validation and the live hub's back-pressure."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from shardwise.telemetry import SCHEMA_VERSION as CORE_SCHEMA_VERSION
from shardwise.telemetry import events as core_events
from shardwise_dashboard import cli
from shardwise_dashboard.live import LiveHub
from shardwise_dashboard.schema import SCHEMA_VERSION, EventBatch
from shardwise_dashboard.settings import Settings


def test_the_schema_version_is_core_s() -> None:
    assert SCHEMA_VERSION == CORE_SCHEMA_VERSION


def test_every_event_core_builds_is_accepted() -> None:
    report = [
        {
            "chunk_id": 0,
            "numel": 3001,
            "state": "gathered",
            "sharded": True,
            "payload": "device",
            "optim": "host",
            "tensors": {"a.weight": "hold", "a.bias": "compute"},
        },
        {
            "chunk_id": 1,
            "numel": 12,
            "state": "sharded",
            "sharded": False,
            "payload": "host",
            "optim": None,
            "tensors": {"frozen.weight": "free"},
        },
        {
            "chunk_id": 2,
            "numel": 64,
            "state": "sharded",
            "sharded": True,
            "payload": "host",
            "optim": "disk",  # the disk tier
            "tensors": {"b.weight": "free"},
        },
    ]
    built = [
        core_events.run_started("r", 0, world_size=2, config={"stage": 3}, num_params=9, host="h"),
        core_events.step(
            "r",
            0,
            step_index=0,
            loss=float("nan"),
            loss_scale=65536.0,
            overflow=True,
            grad_norm=float("inf"),
            step_time_s=0.01,
            comm_bytes={"all_gather": 10, "reduce_scatter": 5},
            moved_bytes={"to_device": 1, "to_host": 2, "to_disk": 3, "from_disk": 4},
            memory={"device": 100, "host": 50, "disk": 60},
            comm_bytes_unquantized={"all_gather": 40, "reduce_scatter": 20},
        ),
        core_events.chunks("r", 0, step_index=0, report=report),
        core_events.evaluation("r", 0, step_index=49, loss=2.25),
        core_events.evaluation("r", 0, step_index=99, loss=float("nan")),
        core_events.run_finished("r", 0, error="boom"),
        core_events.run_finished("r", 0),
        core_events.dropped("r", 0, 7),
    ]
    batch = EventBatch.model_validate({"events": built})
    assert [e.type for e in batch.events] == [e["type"] for e in built]
    assert [e["loss"] for e in built if e["type"] == "eval"] == [2.25, None]
    dumped = [e.model_dump(mode="json", by_alias=True) for e in batch.events]
    for stored, sent in zip(dumped, built, strict=True):
        # Nothing lost or renamed on the way through; a step from a core that does not send
        # the optional skip fields gets their defaults.
        assert {key: stored[key] for key in sent} == sent
        assert {key: stored[key] for key in stored.keys() - sent.keys()} in (
            {},
            {"skipped_in_a_row": 0, "warning": None},
        )


def test_core_s_skipped_steps_and_warning_are_accepted() -> None:
    if "skipped_in_a_row" not in inspect.signature(core_events.step).parameters:
        pytest.skip("core's step event does not carry skipped_in_a_row yet")
    built = core_events.step(
        "r",
        0,
        step_index=9,
        loss=None,
        loss_scale=1.0,
        overflow=True,
        grad_norm=None,
        step_time_s=0.01,
        comm_bytes={},
        moved_bytes={"to_device": 0, "to_host": 0, "to_disk": 0, "from_disk": 0},
        memory={"device": 0, "host": 0, "disk": 0},
        skipped_in_a_row=7,
        warning="w" * 500,
    )
    (event,) = EventBatch.model_validate({"events": [built]}).events
    assert event.model_dump(mode="json", by_alias=True) == built
    assert built["skipped_in_a_row"] == 7 and len(built["warning"]) == 200


def test_a_step_without_the_disk_tier_s_fields_reads_them_as_zero() -> None:
    # Events from before the disk tier carry neither its bytes moved nor its memory.
    built = core_events.step(
        "r",
        0,
        step_index=1,
        loss=1.0,
        loss_scale=1.0,
        overflow=False,
        grad_norm=1.0,
        step_time_s=0.01,
        comm_bytes={},
        moved_bytes={"to_device": 5, "to_host": 6},
        memory={"device": 7, "host": 8},
    )
    (event,) = EventBatch.model_validate({"events": [built]}).events
    dumped = event.model_dump(mode="json", by_alias=True)
    assert dumped["moved_bytes"] == {"to_device": 5, "to_host": 6, "to_disk": 0, "from_disk": 0}
    assert dumped["memory"] == {"device": 7, "host": 8, "disk": 0}


def test_the_unquantized_bytes_travel_beside_the_bytes_sent() -> None:
    """A step's comm_bytes_unquantized (what its collectives would have sent unquantized) is
    stored as core sent it; core fills it with comm_bytes when nothing was quantized; a step
    from a core before it reads it as unknown (null), never as comm_bytes; bad values are
    refused as comm_bytes' are."""
    common: dict[str, Any] = {
        "step_index": 2,
        "loss": 1.0,
        "loss_scale": 1.0,
        "overflow": False,
        "grad_norm": 1.0,
        "step_time_s": 0.01,
        "moved_bytes": {"to_device": 0, "to_host": 0, "to_disk": 0, "from_disk": 0},
        "memory": {"device": 0, "host": 0, "disk": 0},
    }
    sent = {"all_gather": 2_130, "reduce_scatter": 1_065, "all_reduce": 8}
    unquantized = {"all_gather": 8_000, "reduce_scatter": 4_000, "all_reduce": 8}
    quantized = core_events.step(
        "r", 0, comm_bytes=sent, comm_bytes_unquantized=unquantized, **common
    )
    plain = core_events.step("r", 0, comm_bytes=sent, **common)
    assert plain["comm_bytes_unquantized"] == sent
    assert plain["comm_bytes_unquantized"] is not sent  # a copy, not an alias
    older = dict(plain)
    del older["comm_bytes_unquantized"]
    batch = EventBatch.model_validate({"events": [quantized, plain, older]})
    dumped = [e.model_dump(mode="json", by_alias=True) for e in batch.events]
    assert dumped[0] == quantized and dumped[1] == plain
    assert dumped[2]["comm_bytes_unquantized"] is None
    for bad in ({"all_gather": -1}, {"all_gather": 1.5}, {"": 3}, [1, 2]):
        with pytest.raises(ValidationError, match="comm_bytes_unquantized"):
            EventBatch.model_validate({"events": [dict(plain, comm_bytes_unquantized=bad)]})


def test_the_dashboard_never_imports_torch_or_shardwise() -> None:
    code = (
        "import sys, shardwise_dashboard.app, shardwise_dashboard.cli\n"
        "shardwise_dashboard.app.create_app\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'shardwise'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_binding_beyond_loopback_without_a_token_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHARDWISE_DASHBOARD_TOKEN", raising=False)
    for host in ("0.0.0.0", "192.168.1.5", "::", "my-host"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["serve", "--host", host])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert f"refusing to listen on {host} without a token" in error and "--token" in error
    with pytest.raises(SystemExit):
        cli.main(["serve", "--port", "70000"])
    assert "--port must be in 1..65535, got 70000" in capsys.readouterr().err


def test_loopback_addresses() -> None:
    assert all(cli.is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "localhost"))
    assert not any(cli.is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.org"))


def test_settings_refuse_what_they_cannot_honour(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_body_bytes must be >= 1024, got 10"):
        Settings(db_path=tmp_path / "x.sqlite", max_body_bytes=10)
    with pytest.raises(ValueError, match="token must be a non-empty string"):
        Settings(db_path=tmp_path / "x.sqlite", token=" padded ")
    with pytest.raises(TypeError, match=r"db_path must be a pathlib\.Path"):
        Settings(db_path="x.sqlite")  # type: ignore[arg-type]


def test_a_slow_stream_loses_its_oldest_messages_and_is_told_to_resync() -> None:
    async def scenario() -> tuple[list[str], bool, int]:
        hub = LiveHub(queue_size=3)
        slow = hub.subscribe(None)
        other = hub.subscribe("elsewhere")
        for step in range(5):
            hub.publish([{"run_id": "r", "step": step}])
        pending = [slow.queue.get_nowait() for _ in range(slow.queue.qsize())]
        return pending, slow.lagged, other.queue.qsize()

    pending, lagged, other_pending = asyncio.run(scenario())
    assert pending == [f'[{{"run_id": "r", "step": {s}}}]' for s in (2, 3, 4)]
    assert lagged and other_pending == 0
