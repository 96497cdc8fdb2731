"""Reliability edges: every rank fails alike with a clear message, nothing silent, no hang."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, make_model

from shardwise import (
    CommOp,
    MixedPrecision,
    checkpoint,
    telemetry,
    zero_model_wrapper,
    zero_optim_wrapper,
)
from shardwise.engine.optimizer import SkippedStepsWarning, optimizer_of
from shardwise.runtime.rank_sync import RanksOutOfStep
from shardwise.testing import run_ranks

CPU = torch.device("cpu")


def _build(stage: int, optim: str = "adamw", **optim_kwargs: Any) -> tuple[Any, Any]:
    config: dict[str, Any] = {"device": CPU}
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    model = make_model()
    wrapped = zero_model_wrapper(model, stage, config)
    inner = (
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        if optim == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    return wrapped, zero_optim_wrapper(wrapped, inner, **optim_kwargs)


def _step(wrapped: Any, optimizer: Any, step: int) -> float:
    optimizer.zero_grad()
    loss = wrapped(*batch_slice(step, 0, dist.get_rank(), dist.get_world_size()))
    optimizer.backward(loss)
    optimizer.step()
    return float(loss.detach())


def _error_of(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except Exception as error:  # every rank reports what it raised
        return type(error).__name__, str(error)
    return "none", ""


# ---- checkpoints ------------------------------------------------------------------------------


def _save_into_ordinary_directory(path: str) -> dict[str, Any]:
    wrapped, optimizer = _build(2)
    _step(wrapped, optimizer, 0)
    kind, message = _error_of(checkpoint.save, path, wrapped, optimizer)
    # A rank that catches the error carries on, and the ranks still meet in collectives.
    after = _step(wrapped, optimizer, 1)
    return {"kind": kind, "message": message, "after": after}


def test_save_into_an_ordinary_directory_fails_on_every_rank_and_writes_nothing(
    tmp_path: Path,
) -> None:
    target = tmp_path / "outputs"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    results = run_ranks(_save_into_ordinary_directory, 2, str(target), timeout_s=60)
    for result in results:
        assert result["kind"] == "CheckpointError", result
        assert "ordinary directory" in result["message"]
    assert results[0]["after"] != results[1]["after"]  # each rank trained its own slice
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]


def _save_over_a_file(path: str) -> dict[str, Any]:
    wrapped, optimizer = _build(2)
    _step(wrapped, optimizer, 0)
    kind, message = _error_of(checkpoint.save, path, wrapped, optimizer)
    kept = Path(path).read_text()  # refused before anything is written
    dist.barrier()  # every rank read the file before it is replaced
    checkpoint.save(path, wrapped, optimizer, extra={"step": 1}, replace_file=True)
    other, other_optimizer = _build(2)
    extra = checkpoint.load(path, other, other_optimizer)
    return {"kind": kind, "message": message, "kept": kept, "extra": extra}


def test_a_file_is_replaced_only_when_asked(tmp_path: Path) -> None:
    # Another kind of checkpoint under the same name (a Lightning "full" .ckpt file).
    target = tmp_path / "last.ckpt"
    target.write_text("a full checkpoint")
    for result in run_ranks(_save_over_a_file, 2, str(target), timeout_s=60):
        assert result["kind"] == "CheckpointError", result
        assert "ordinary file" in result["message"]
        assert result["kept"] == "a full checkpoint"
        assert result["extra"] == {"step": 1}
    assert target.is_symlink() and (target / "manifest.json").is_file()
    assert len(list(tmp_path.iterdir())) == 2  # the link and the one version it names


def _save_then_load_with(path: str, saved: str, loaded: str) -> tuple[str, str]:
    wrapped, optimizer = _build(2, saved)
    _step(wrapped, optimizer, 0)
    checkpoint.save(path, wrapped, optimizer)
    other, other_optimizer = _build(2, loaded)
    return _error_of(checkpoint.load, path, other, other_optimizer)


@pytest.mark.parametrize(("saved", "loaded"), [("adamw", "sgd"), ("sgd", "adamw")])
def test_loading_another_optimizers_state_is_refused(
    saved: str, loaded: str, tmp_path: Path
) -> None:
    results = run_ranks(_save_then_load_with, 2, str(tmp_path / "ckpt"), saved, loaded)
    names = {"adamw": "torch.optim.adamw.AdamW", "sgd": "torch.optim.sgd.SGD"}
    for kind, message in results:
        assert kind == "CheckpointError", message
        assert names[saved] in message and names[loaded] in message, message


def _load_truncated(path: str) -> tuple[str, str]:
    wrapped, optimizer = _build(2)
    return _error_of(checkpoint.load, path, wrapped, optimizer, verify_checksums=False)


def _load(path: str) -> Any:
    wrapped, optimizer = _build(2)
    return checkpoint.load(path, wrapped, optimizer)


def _save(path: str) -> None:
    wrapped, optimizer = _build(2)
    _step(wrapped, optimizer, 0)
    checkpoint.save(path, wrapped, optimizer, extra={"step": 1})


def test_truncated_file_without_checksums_raises_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_ranks(_save, 2, str(path))
    data = sorted(path.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])
    for kind, message in run_ranks(_load_truncated, 2, str(path), timeout_s=60):
        assert kind == "CheckpointError", message
        assert "could not be read" in message


def test_unfinished_saves_are_removed_by_the_next_load_and_save(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_ranks(_save, 2, str(path))
    published = os.readlink(path)
    for token in ("0123456789ab", "ba9876543210"):
        unfinished = tmp_path / f"ckpt.{token}"
        unfinished.mkdir()
        (unfinished / "__0_0.distcp").write_bytes(b"half")
    unrelated = tmp_path / "ckpt.keep"
    unrelated.mkdir()
    assert run_ranks(_load, 2, str(path)) == [{"step": 1}] * 2
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["ckpt", published, "ckpt.keep"]), names
    (tmp_path / "ckpt.0123456789ab").mkdir()
    run_ranks(_save, 2, str(path))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 3 and "ckpt.0123456789ab" not in names and published not in names


# ---- wrapping ---------------------------------------------------------------------------------


def test_nan_max_norm_is_refused() -> None:
    wrapped = zero_model_wrapper(make_model(), 2, {"device": CPU})
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        zero_optim_wrapper(
            wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), max_norm=math.nan
        )


@pytest.mark.parametrize("stage", [2, 3])
def test_wrapping_before_init_process_group_under_a_launcher_is_refused(
    stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="init_process_group"):
        zero_model_wrapper(make_model(), stage, {"device": CPU})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_wrapping_a_module_twice_is_refused(stage: int) -> None:
    model = make_model()
    zero_model_wrapper(model, stage, {"device": CPU})
    with pytest.raises(ValueError, match="already wrapped by shardwise"):
        zero_model_wrapper(model, stage, {"device": CPU})


@pytest.mark.parametrize("stage", [1, 3])
def test_a_second_optimizer_over_one_model_is_refused_until_the_first_is_closed(
    stage: int,
) -> None:
    model = make_model()
    wrapped = zero_model_wrapper(model, stage, {"device": CPU})
    first = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already has a ZeroOptimizer"):
        zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    first.close()
    second = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    assert optimizer_of(wrapped) is second
    with pytest.raises(ValueError, match="closed"):
        first.step()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")
@pytest.mark.parametrize("stage", [1, 3])
def test_cuda_device_without_cuda_names_the_setting(stage: int) -> None:
    with pytest.raises(ValueError, match=r"gemini_config\['device'\].*torch.device\('cpu'\)"):
        zero_model_wrapper(make_model(), stage, {"device": "cuda"})


# ---- steps skipped forever --------------------------------------------------------------------


def _always_non_finite(precision: MixedPrecision, warn_after: int, steps: int) -> dict[str, Any]:
    config: dict[str, Any] = {"device": CPU, "mixed_precision": precision}
    model = make_model()
    wrapped = zero_model_wrapper(model, 2, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        initial_scale=8,
        min_scale=1,
        warn_after_skipped_steps=warn_after,
    )
    path = os.environ["TEST_TELEMETRY_FILE"]
    recorder = telemetry.enable(wrapped, optimizer, path=path)
    assert recorder is not None
    before = {k: v.clone() for k, v in wrapped.state_dict(only_rank_0=False).items()}
    warned_at = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, dist.get_rank(), 2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.backward(loss * float("inf") if dist.get_rank() == 1 else loss)
            optimizer.step()
        if any(issubclass(w.category, SkippedStepsWarning) for w in caught):
            warned_at.append(step)
    recorder.finish()
    after = wrapped.state_dict(only_rank_0=False)
    return {
        "warned_at": warned_at,
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "warning": optimizer.skip_warning,
        "scale": optimizer.loss_scale,
    }


@pytest.mark.parametrize(
    ("precision", "first_warning"),
    [
        # Nothing to back off: every skip counts.
        (MixedPrecision(), 3),
        # fp16: the scale backs off 8 -> 4 at the second overflow (hysteresis 2), then at
        # each: 4 -> 2 -> 1; only the skips at the minimum scale count.
        (MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32), 4 + 3),
    ],
)
def test_steps_skipped_forever_warn_and_reach_telemetry(
    precision: MixedPrecision, first_warning: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_TELEMETRY_FILE", str(tmp_path / "events"))
    steps = first_warning + 3 + 1
    results = run_ranks(_always_non_finite, 2, precision, 3, steps)
    for result in results:
        assert result["unchanged"], "a skipped step changed the model"
        assert result["warned_at"] == [first_warning - 1, first_warning + 2], result
        assert "in a row were skipped" in result["warning"]
    assert results[0]["scale"] == 1.0
    events = [
        json.loads(line)
        for line in (tmp_path / "events.rank0.jsonl").read_text().splitlines()
        if '"step"' in line
    ]
    steps_seen = [e for e in events if e["type"] == "step"]
    assert [e["skipped_in_a_row"] for e in steps_seen] == list(range(1, steps + 1))
    warned = [e["step"] for e in steps_seen if e["warning"]]
    assert warned[0] == first_warning - 1 and warned[-1] == steps - 1


# ---- ranks out of step ------------------------------------------------------------------------


def _rank_skips_a_batch(stage: int) -> tuple[str, str]:
    """Rank 1 meets a bad batch at step 2 after its forward, catches the error and goes on
    with the next batch, as a loop with `try/except: continue` does."""
    wrapped, optimizer = _build(stage)
    rank = dist.get_rank()

    def train() -> None:
        batch = 0
        for _ in range(5):
            optimizer.zero_grad()
            loss = wrapped(*batch_slice(batch, 0, rank, 2))
            batch += 1
            if rank == 1 and batch == 3:
                continue  # "loss was nan, skip this batch"
            optimizer.backward(loss)
            optimizer.step()

    return _error_of(train)


def _rank0_evaluates_alone(stage: int) -> tuple[str, str]:
    wrapped, optimizer = _build(stage)
    rank = dist.get_rank()

    def train() -> None:
        for step in range(3):
            _step(wrapped, optimizer, step)
            if rank == 0:
                with torch.no_grad():
                    wrapped(*batch_slice(9, 0, 0, 2))

    return _error_of(train)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_rank_that_skips_a_batch_stops_every_rank_with_what_each_did(stage: int) -> None:
    results = run_ranks(_rank_skips_a_batch, 2, stage, timeout_s=60)
    for kind, message in results:
        assert kind == RanksOutOfStep.__name__, message
        assert "rank 0:" in message and "rank 1:" in message, message
    assert results[0][1] == results[1][1]


def test_a_forward_on_rank_0_only_stops_stage_3_on_every_rank() -> None:
    results = run_ranks(_rank0_evaluates_alone, 2, 3, timeout_s=60)
    for kind, message in results:
        assert kind == "RanksOutOfStep", message
        assert "without gradients" in message


@pytest.mark.parametrize("stage", [1, 2])
def test_a_forward_without_gradients_on_rank_0_only_is_harmless_at_stages_1_and_2(
    stage: int,
) -> None:
    # No collective runs in such a forward at stages 1-2, so nothing is out of step.
    assert run_ranks(_rank0_evaluates_alone, 2, stage, timeout_s=60) == [("none", "")] * 2


def _control_traffic_of_a_save(path: str) -> tuple[int, int]:
    wrapped, optimizer = _build(2)
    before = wrapped.comm_stats.calls(CommOp.CONTROL)
    checkpoint.save(path, wrapped, optimizer)
    after_save = wrapped.comm_stats.calls(CommOp.CONTROL)
    checkpoint.load(path, wrapped, optimizer)
    return after_save - before, wrapped.comm_stats.calls(CommOp.CONTROL) - after_save


def test_checkpoint_agreements_go_through_the_models_counted_collectives(tmp_path: Path) -> None:
    for saved, loaded in run_ranks(_control_traffic_of_a_save, 2, str(tmp_path / "ckpt")):
        # save: the target check, the version token, barriers, the key union, the file list;
        # load: the checksum verdict.
        assert saved >= 5 and loaded >= 1, (saved, loaded)
