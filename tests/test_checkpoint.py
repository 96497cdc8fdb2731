"""Sharded checkpoints: exact resume, other world sizes and stages, atomicity, verification."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, logged_messages, make_model, max_abs_diff

from shardwise import MixedPrecision, checkpoint, zero_model_wrapper, zero_optim_wrapper
from shardwise.chunk import Pool
from shardwise.testing import RankFailure, run_ranks


def _build(
    stage: int,
    precision: MixedPrecision | None = None,
    placement: dict[str, Any] | None = None,
    compiled: bool = False,
) -> tuple[Any, Any]:
    config: dict[str, Any] = {"device": torch.device("cpu"), **(placement or {})}
    if precision is not None:
        config["mixed_precision"] = precision
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    model = make_model()
    if compiled:
        model = torch.compile(model, backend="eager")
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        optim_config={"reduce_bucket_size": CHUNK_NUMEL + 7} if stage < 3 else None,
        growth_interval=2,
    )
    return wrapped, optimizer


def _train(wrapped: Any, optimizer: Any, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, world))
        optimizer.backward(loss)
        optimizer.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total / world))
    return losses


def _train_and_save(
    stage: int, path: str, precision: MixedPrecision | None, placement: dict[str, Any] | None = None
) -> dict[str, Any]:
    wrapped, optimizer = _build(stage, precision, placement)
    _train(wrapped, optimizer, range(3))
    # Where each chunk's shard and optimizer side were when saved.
    pools = [(c.placement.payload, c.placement.optim) for c in wrapped.chunk_manager.chunks]
    checkpoint.save(path, wrapped, optimizer, extra={"step": 3, "rng": torch.get_rng_state()})
    after = _train(wrapped, optimizer, range(3, 6))
    return {
        "losses_after": after,
        "scale": optimizer.loss_scale,
        "state": wrapped.state_dict(),
        "pools": pools,
    }


def _load_and_train(
    stage: int, path: str, precision: MixedPrecision | None, placement: dict[str, Any] | None = None
) -> dict[str, Any]:
    wrapped, optimizer = _build(stage, precision, placement)
    extra = checkpoint.load(path, wrapped, optimizer)
    scale = optimizer.loss_scale
    after = _train(wrapped, optimizer, range(3, 6))
    return {"extra_step": extra["step"], "scale": scale, "losses_after": after}


FP16 = MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_is_exact(stage: int, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_train_and_save, 2, stage, path, FP16)[0]
    resumed = run_ranks(_load_and_train, 2, stage, path, FP16)[0]
    assert resumed["extra_step"] == 3
    assert resumed["losses_after"] == saved["losses_after"]
    assert Path(path).is_symlink()


@pytest.mark.parametrize(
    ("save_world", "save_stage", "load_world", "load_stage"),
    [(2, 2, 1, 3), (2, 3, 4, 1), (4, 1, 2, 3), (2, 3, 2, 2)],
)
def test_load_at_other_world_size_and_stage(
    save_world: int, save_stage: int, load_world: int, load_stage: int, tmp_path: Path
) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_train_and_save, save_world, save_stage, path, None)[0]
    resumed = run_ranks(_load_and_train, load_world, load_stage, path, None)[0]
    # Another world size sums gradients in another order: a last-bit difference (see
    # test_parity's note on tolerances).
    assert resumed["losses_after"] == pytest.approx(saved["losses_after"], abs=1e-5)


def test_resume_under_another_placement_is_exact(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    cpu = {"placement_policy": "cpu"}
    static = {"placement_policy": "static", "offload_optim_frac": 1.0, "offload_param_frac": 0.5}
    saved = run_ranks(_train_and_save, 2, 3, path, FP16, cpu)[0]
    resumed = run_ranks(_load_and_train, 2, 3, path, FP16, static)[0]
    assert resumed["losses_after"] == saved["losses_after"]


@pytest.mark.parametrize(
    "load_placement",
    [
        {"placement_policy": "auto", "device_budget_bytes": 270_000},
        {"placement_policy": "cuda"},
    ],
    ids=["auto-smaller-budget", "cuda"],
)
def test_resume_from_auto_placement_is_exact(
    tmp_path: Path, load_placement: dict[str, Any]
) -> None:
    # Saved while "auto" kept some shards and optimizer sides on the device and others in
    # host memory (checked), resumed under another budget's plan or with everything on the
    # device: the optimizer state and the parameters come back wherever they now live.
    path = str(tmp_path / "ckpt")
    auto = {"placement_policy": "auto", "device_budget_bytes": 350_000}
    saved = run_ranks(_train_and_save, 2, 3, path, FP16, auto)[0]
    optim_pools = {optim for _, optim in saved["pools"]}
    assert optim_pools == {Pool.DEVICE, Pool.HOST}, saved["pools"]
    resumed = run_ranks(_load_and_train, 2, 3, path, FP16, load_placement)[0]
    assert resumed["losses_after"] == saved["losses_after"]


def test_resume_from_state_on_the_disk_tier_at_the_same_and_another_world_size(
    tmp_path: Path,
) -> None:
    # Saved while every master and optimizer state was in the disk tier's files (see [Note:
    # the disk tier] in memory/disk_pool.py), resumed exactly on the disk tier again, and at 4
    # ranks in memory (another world size sums in another order: the last bits).
    path = str(tmp_path / "ckpt")
    disk = {
        "placement_policy": "cpu",
        "nvme_offload_fraction": 1.0,
        "nvme_offload_dir": str(tmp_path / "disk"),
    }
    saved = run_ranks(_train_and_save, 2, 3, path, FP16, disk)[0]
    assert {optim for _, optim in saved["pools"]} == {Pool.DISK}
    again = run_ranks(_load_and_train, 2, 3, path, FP16, disk)[0]
    assert again["losses_after"] == saved["losses_after"]
    assert again["scale"] == saved["scale"]
    wider = run_ranks(_load_and_train, 4, 2, path, FP16, None)[0]
    assert wider["losses_after"] == pytest.approx(saved["losses_after"], abs=1e-5)


def _save_model_only(path: str) -> dict[str, torch.Tensor]:
    wrapped, optimizer = _build(3)
    _train(wrapped, optimizer, range(2))
    checkpoint.save(path, wrapped)
    return wrapped.state_dict()


def _load_model_only(path: str) -> dict[str, torch.Tensor]:
    wrapped, _ = _build(2)
    checkpoint.load(path, wrapped)
    return wrapped.state_dict()


def test_model_only_round_trip_is_exact(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_model_only, 2, path)[0]
    loaded = run_ranks(_load_model_only, 4, path)[0]
    assert max_abs_diff(saved, loaded) == 0.0


def _save_compiled_or_not(path: str, compiled: bool) -> dict[str, torch.Tensor]:
    wrapped, optimizer = _build(3, compiled=compiled)
    _train(wrapped, optimizer, range(2))
    checkpoint.save(path, wrapped, optimizer)
    return _own_names(wrapped.state_dict())


def _load_compiled_or_not(path: str, compiled: bool) -> dict[str, Any]:
    wrapped, optimizer = _build(3, compiled=compiled)
    checkpoint.load(path, wrapped, optimizer)
    return _own_names(wrapped.state_dict())


def _own_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key.removeprefix("_orig_mod."): value for key, value in state.items()}


@pytest.mark.parametrize("saved_compiled", [True, False])
def test_compiling_the_model_or_not_between_save_and_load(
    saved_compiled: bool, tmp_path: Path
) -> None:
    # torch.compile(model)'s wrapper puts `_orig_mod.` before every name; a checkpoint holds
    # the model's own names, so a run may turn compilation on or off when it resumes.
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_compiled_or_not, 2, path, saved_compiled)[0]
    loaded = run_ranks(_load_compiled_or_not, 2, path, not saved_compiled)[0]
    assert sorted(saved) == sorted(loaded)
    assert max_abs_diff(saved, loaded) == 0.0


def _load_expecting_error(path: str, variant: str) -> str:
    if variant == "other_model":
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3))
        wrapped = zero_model_wrapper(model, 2, {"device": torch.device("cpu")})
        optimizer = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    else:
        wrapped, optimizer = _build(3)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(path, wrapped, optimizer)
    return str(info.value)


def test_corrupted_foreign_and_missing_checkpoints_fail_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_ranks(_train_and_save, 2, 3, str(path), None)
    messages = run_ranks(_load_expecting_error, 2, str(path), "other_model")
    assert all("another model" in m or "lacks" in m for m in messages), messages
    data = sorted(path.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    messages = run_ranks(_load_expecting_error, 2, str(path), "same")
    assert all("corrupted" in m and data.name in m for m in messages), messages
    messages = run_ranks(_load_expecting_error, 2, str(tmp_path / "absent"), "same")
    assert all("no checkpoint" in m for m in messages)


def _save_that_crashes(path: str) -> None:
    wrapped, optimizer = _build(2)
    _train(wrapped, optimizer, range(1))
    if dist.get_rank() == 1:
        os._exit(3)  # a rank dies in the middle of the save
    checkpoint.save(path, wrapped, optimizer, extra={"step": 99})


def test_crash_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(_train_and_save, 2, 2, path, None)
    before = os.readlink(path)
    with pytest.raises(RankFailure, match="rank 1"):
        run_ranks(_save_that_crashes, 2, path, timeout_s=20)
    assert os.readlink(path) == before
    resumed = run_ranks(_load_and_train, 2, 2, path, None)[0]
    assert resumed["extra_step"] == 3


def _export(path: str) -> dict[str, torch.Tensor]:
    wrapped, optimizer = _build(3)
    _train(wrapped, optimizer, range(2))
    checkpoint.export_hf(path, wrapped, max_shard_bytes=40_000)
    checkpoint.export_hf(path + "-bf16", wrapped, dtype=torch.bfloat16)
    return wrapped.state_dict()


def _import(path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    wrapped, _ = _build(2)
    checkpoint.load_hf(path, wrapped)
    return wrapped.state_dict()


def test_hugging_face_export_and_sharded_import(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file

    path = tmp_path / "hf"
    trained = run_ranks(_export, 2, str(path))[0]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    exported: dict[str, torch.Tensor] = {}
    for file in files:
        exported.update(load_file(str(path / file)))
    # Every parameter once (the tied head is the embedding), unpadded, original shapes.
    assert "gpt.lm_head.weight" not in exported
    for name, value in exported.items():
        assert torch.equal(value, trained[name]), name
    assert set(trained) - set(exported) == {"gpt.lm_head.weight"}
    loaded = run_ranks(_import, 4, str(path))[0]
    assert max_abs_diff(loaded, trained) == 0.0
    # Cast on the way out; under the default file limit still files of at most half the whole,
    # so that no rank writes (or holds) the whole model.
    bf16 = tmp_path / "hf-bf16"
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    cast = {name: v for file in files for name, v in load_file(str(bf16 / file)).items()}
    assert sorted(cast) == sorted(exported)
    for name, value in cast.items():
        assert torch.equal(value, trained[name].to(torch.bfloat16)), name


def _logged_save_and_load(path: str) -> list[str]:
    messages = logged_messages("shardwise.checkpoint")
    model = make_model()
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL}
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    checkpoint.save(path, wrapped, optimizer)
    checkpoint.load(path, wrapped, optimizer)
    return messages


def test_a_save_and_a_load_log_each_ranks_progress(tmp_path: Path) -> None:
    # A big model's save or load is one long call: its progress is logged as it goes, at each
    # tenth of the rank's bytes, ending at all of them.
    for rank, messages in enumerate(run_ranks(_logged_save_and_load, 2, str(tmp_path / "ck"))):
        for verb in ("saved", "read"):
            lines = [m for m in messages if m.startswith(f"rank {rank}: {verb} ")]
            assert len(lines) >= 2 and "(100%" in lines[-1], messages


def _bars_of_save_and_load(path: str) -> list[str]:
    """What a save and a load drew on this rank's stderr (not a terminal), with progress=True,
    with the default and with progress=False."""
    model = make_model()
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL}
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    drawn = []
    for case, progress in enumerate((True, None, False)):
        with contextlib.redirect_stderr(io.StringIO()) as stderr:
            checkpoint.save(f"{path}-{case}", wrapped, optimizer, progress=progress)
            checkpoint.load(f"{path}-{case}", wrapped, optimizer, progress=progress)
        drawn.append(stderr.getvalue())
    return drawn


def _has_bar(text: str, description: str) -> bool:
    return any(description in line and "100%" in line for line in text.split("\r"))


@pytest.mark.parametrize("environment", [None, "1"])
def test_a_save_and_a_load_draw_a_bar_on_rank_0_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, environment: str | None
) -> None:
    # With default logging the INFO lines are not shown: rank 0 draws a bar where asked
    # (progress=True, or SHARDWISE_PROGRESS=1 for the default), and no other rank does.
    if environment is None:
        monkeypatch.delenv("SHARDWISE_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("SHARDWISE_PROGRESS", environment)
    rank_0, rank_1 = run_ranks(_bars_of_save_and_load, 2, str(tmp_path / "ck"))
    asked, default, refused = rank_0
    for description in ("checkpoint save", "checkpoint load"):
        assert _has_bar(asked, description), asked
        assert _has_bar(default, description) == (environment == "1"), default
        assert description not in refused, refused
        assert not any(description in text for text in rank_1), rank_1
