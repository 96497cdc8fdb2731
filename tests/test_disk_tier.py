"""The disk tier (see [Note: the disk tier] in memory/disk_pool.py and [Note: the disk tier in
the step] in engine/step_loop.py) on 2 gloo ranks: every way of asking for it trains bit for
bit as the same run in memory, moves what it should, removes its files when the optimizer is
closed, and a failed read or write raises the same error on every rank with the model and
optimizer left as they were before the step.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, logged_messages, make_model

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
from shardwise.chunk import Pool
from shardwise.memory import disk_pool
from shardwise.memory.disk_pool import DiskTierError
from shardwise.optim import HybridAdam
from shardwise.testing import run_ranks

STEPS = 3
FP16 = MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32)


def _optimizer(params: Any, nvme: dict[str, Any]) -> torch.optim.Optimizer:
    """HybridAdam where the case gives its NVMe arguments (0.0 for the run in memory)."""
    if nvme:
        return HybridAdam(params, lr=1e-2, weight_decay=0.1, **nvme)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def _wrapped_run(
    stage: int, gemini: dict[str, Any], nvme: dict[str, Any], fp16: bool, optim_config: Any
) -> dict[str, Any]:
    rank = dist.get_rank()
    # Stage 3 refuses a branch some ranks skip outside its gather units.
    model = make_model(branch="some_ranks" if stage < 3 else "always")
    config: dict[str, Any] = {"device": torch.device("cpu"), **gemini}
    if fp16:
        config["mixed_precision"] = FP16
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    wrapped = zero_model_wrapper(model, stage, config)
    # Stage 3's optimizer sides its placement kept off the device, where the disk tier takes
    # them from (stages 1-2 pack only once the optimizer is wrapped).
    off_device = (
        sum(c.placement.optim is not Pool.DEVICE for c in wrapped.chunk_manager.trainable_chunks())
        if stage == 3
        else 0
    )
    optimizer = zero_optim_wrapper(
        wrapped,
        _optimizer(model.parameters(), nvme),
        initial_scale=2**10,
        max_norm=0.5,
        optim_config=optim_config,
    )
    losses = []
    moved = []
    gemini_manager = wrapped.gemini_manager
    for step in range(STEPS):
        before = gemini_manager.bytes_moved() if gemini_manager is not None else {}
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, 2))
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss))
        if gemini_manager is not None:
            after = gemini_manager.bytes_moved()
            moved.append({k: after[k] - before[k] for k in ("to_disk", "from_disk")})
    chunks = list(wrapped.chunk_manager.trainable_chunks())
    on_disk = [c for c in chunks if c.placement.optim is Pool.DISK]
    result = {
        "losses": losses,
        "params": wrapped.state_dict(only_rank_0=False),
        "state": optimizer.state_dict()["optimizer"]["state"],
        "on_disk": len(on_disk),
        "chunks": len(chunks),
        "off_device_at_wrap": off_device,
        # What one step reads and writes: each disk chunk's master and two moments, fp32.
        "per_step": sum(4 * 3 * c.master.numel() for c in on_disk),
        "moved": moved,
        "pools": gemini_manager.memory_by_pool() if gemini_manager is not None else {},
    }
    directory = optimizer.disk.path if optimizer.disk is not None else None
    optimizer.close()
    result["files_left"] = directory is not None and directory.exists()
    result["back_in_memory"] = all(c.placement.optim is Pool.HOST for c in on_disk)
    return result


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        torch.equal(a[k], b[k])
        if isinstance(a[k], torch.Tensor)
        else (_same(a[k], b[k]) if isinstance(a[k], dict) else a[k] == b[k])
        for k in a
    )


def _compare(cases: list[tuple[Any, ...]], directory: str) -> list[str]:
    problems = []
    for stage, gemini, nvme, fp16, optim_config, expect_on_disk in cases:
        case = f"stage {stage} {gemini} {nvme} fp16={fp16}"
        in_memory = {k: v for k, v in gemini.items() if not k.startswith(("nvme", "host_"))}
        plain = _wrapped_run(
            stage, in_memory, {"nvme_offload_fraction": 0.0} if nvme else {}, fp16, optim_config
        )
        nvme = {**nvme, "nvme_offload_dir": directory} if nvme else {}
        if any(k.startswith(("nvme", "host_")) for k in gemini):
            gemini = {**gemini, "nvme_offload_dir": directory}
        on_disk = _wrapped_run(stage, gemini, nvme, fp16, optim_config)
        if on_disk["on_disk"] != expect_on_disk(on_disk):
            problems.append(f"{case}: {on_disk['on_disk']} of {on_disk['chunks']} on disk")
        for part in ("losses", "params", "state"):
            if not _same({"x": plain[part]}, {"x": on_disk[part]}):
                problems.append(f"{case}: {part} differ")
        expected = {"to_disk": on_disk["per_step"], "from_disk": on_disk["per_step"]}
        # The first step reads masters only (no state yet) and writes the state it made.
        if on_disk["moved"][1:] != [expected] * (STEPS - 1):
            problems.append(f"{case}: moved {on_disk['moved']}, expected {expected} a step")
        if on_disk["pools"].get("disk", 0) != on_disk["per_step"]:
            problems.append(f"{case}: pools {on_disk['pools']}")
        if on_disk["files_left"] or not on_disk["back_in_memory"]:
            problems.append(f"{case}: close() left files or sides on disk")
    return problems


def _all(run: dict[str, Any]) -> int:
    return int(run["chunks"])


def _half(run: dict[str, Any]) -> int:
    return int(run["chunks"]) // 2


def _off_the_device(run: dict[str, Any]) -> int:
    return int(run["off_device_at_wrap"])


CASES = [
    # Stage 3, "cpu" placement, the disk fraction in gemini_config.
    (3, {"placement_policy": "cpu", "nvme_offload_fraction": 1.0}, {}, False, None, _all),
    (3, {"placement_policy": "cpu", "nvme_offload_fraction": 0.5}, {}, True, None, _half),
    # HybridAdam's own NVMe arguments, as ColossalAI's users give them.
    (3, {"placement_policy": "cpu"}, {"nvme_offload_fraction": 0.5}, False, None, _half),
    # Stages 1 and 2 with cpu_offload.
    (
        2,
        {"placement_policy": "cpu"},
        {"nvme_offload_fraction": 1.0},
        True,
        {"reduce_bucket_size": CHUNK_NUMEL},
        _all,
    ),
    (
        1,
        {"nvme_offload_fraction": 1.0},
        {},
        False,
        {"reduce_bucket_size": CHUNK_NUMEL, "cpu_offload": True},
        _all,
    ),
    # "auto" with a host budget that holds no optimizer side: every side its plan keeps off
    # the device (see [Note: auto places from the wrap]) spills to disk, here about half.
    (
        3,
        {"placement_policy": "auto", "device_budget_bytes": 200_000, "host_budget_bytes": 1},
        {},
        False,
        None,
        _off_the_device,
    ),
]


def test_every_way_to_the_disk_tier_trains_bit_for_bit_as_in_memory(tmp_path: Path) -> None:
    for problems in run_ranks(_compare, 2, CASES, str(tmp_path)):
        assert problems == []
    assert not any(tmp_path.iterdir())  # every rank's folder went with its optimizer


def _boosted(nvme: float, directory: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank = dist.get_rank()
    booster = Booster(
        plugin=GeminiPlugin(precision="fp32", placement_policy="static", offload_optim_frac=1.0)
    )
    model = make_model()
    optimizer = HybridAdam(
        model.parameters(), lr=1e-2, nvme_offload_fraction=nvme, nvme_offload_dir=directory
    )
    model, optimizer, *_ = booster.boost(model, optimizer)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(*batch_slice(step, 0, rank, 2))
        booster.backward(loss, optimizer)
        optimizer.step()
        losses.append(float(loss))
    return losses, model.state_dict(only_rank_0=False)


def test_the_booster_with_hybrid_adam_nvme_offload_trains_as_in_memory(tmp_path: Path) -> None:
    plain = run_ranks(_boosted, 2, 0.0, str(tmp_path))
    on_disk = run_ranks(_boosted, 2, 1.0, str(tmp_path))
    for (losses, state), (ref_losses, ref_state) in zip(on_disk, plain, strict=True):
        assert losses == ref_losses
        assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def _failing(where: str, directory: str) -> dict[str, Any]:
    """Step twice; on the third step rank 1 fails a read or a write of its disk tier midway.
    Returns what each rank saw, and whether the failed step left everything as before."""
    rank = dist.get_rank()
    model = make_model()
    config = {
        "device": torch.device("cpu"),
        "chunk_size_numel": CHUNK_NUMEL,
        "placement_policy": "cpu",
        "nvme_offload_fraction": 1.0,
        "nvme_offload_dir": directory,
        "mixed_precision": FP16,
    }
    wrapped = zero_model_wrapper(model, 3, config)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))

    def step(number: int) -> None:
        optimizer.zero_grad()
        optimizer.backward(wrapped(*batch_slice(number, 0, rank, 2)))
        optimizer.step()

    for number in range(2):
        step(number)
    before_params = wrapped.state_dict(only_rank_0=False)
    before_state = optimizer.state_dict()
    transfer, calls = disk_pool._transfer, 0

    def flaky(path: Path, buffers: list[memoryview], *, write: bool) -> None:
        nonlocal calls
        if write == (where == "write") and rank == 1:
            calls += 1
            if calls == 2:
                raise OSError(28, "No space left on device")
        transfer(path, buffers, write=write)

    disk_pool._transfer = flaky
    message = ""
    try:
        step(2)
    except DiskTierError as error:
        message = str(error)
    finally:
        disk_pool._transfer = transfer
    unchanged = _same(wrapped.state_dict(only_rank_0=False), before_params) and _same(
        optimizer.state_dict(), before_state
    )
    step(2)  # the disk works again: the same step, retried
    step(3)
    return {"message": message, "unchanged": unchanged, "params": wrapped.state_dict()}


def _uninterrupted() -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    model = make_model()
    config = {
        "device": torch.device("cpu"),
        "chunk_size_numel": CHUNK_NUMEL,
        "placement_policy": "cpu",
        "mixed_precision": FP16,
    }
    wrapped = zero_model_wrapper(model, 3, config)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for number in range(4):
        optimizer.zero_grad()
        optimizer.backward(wrapped(*batch_slice(number, 0, rank, 2)))
        optimizer.step()
    return wrapped.state_dict()


@pytest.mark.parametrize("where", ["read", "write"])
def test_a_failed_read_or_write_raises_on_every_rank_and_loses_nothing(
    where: str, tmp_path: Path
) -> None:
    results = run_ranks(_failing, 2, where, str(tmp_path))
    reference = run_ranks(_uninterrupted, 2)[0]
    for result in results:
        assert "rank 1, " in result["message"] and "No space left" in result["message"]
        assert "rolled back on every rank" in result["message"]
        assert result["unchanged"]
    # Retried once the disk works, the run is the one that never failed.
    assert _same(results[0]["params"], reference)


def _refused(options: dict[str, Any]) -> str:
    model = make_model()
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL, **options}
    )
    try:
        zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters()))
    except ValueError as error:
        return str(error)
    return "accepted"


def test_the_disk_tier_without_optimizer_state_in_host_memory_is_refused() -> None:
    (message,) = run_ranks(_refused, 1, {"nvme_offload_fraction": 0.5})
    assert "keeps none there" in message and "placement_policy='cpu'" in message


def test_hybrid_adam_nvme_offload_outside_the_engine_is_refused() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = HybridAdam(model.parameters(), nvme_offload_fraction=0.5)
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(ValueError, match="honoured only when the engine steps"):
        optimizer.step()


def test_low_level_zero_cpu_offload_with_nvme_trains(tmp_path: Path) -> None:
    def run(nvme: float) -> list[float]:
        rank = dist.get_rank()
        booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32", cpu_offload=True))
        model = make_model()
        optimizer = HybridAdam(
            model.parameters(), lr=1e-2, nvme_offload_fraction=nvme, nvme_offload_dir=str(tmp_path)
        )
        model, optimizer, *_ = booster.boost(model, optimizer)
        losses = []
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = model(*batch_slice(step, 0, rank, 2))
            booster.backward(loss, optimizer)
            optimizer.step()
            losses.append(float(loss))
        return losses

    assert run_ranks(run, 2, 1.0) == run_ranks(run, 2, 0.0)


def _booster_resume(directory: str, save: str, steps_before: int) -> list[float]:
    """Train with the Booster, state on the disk tier; save model and optimizer after
    `steps_before` steps, then train on; or, when `steps_before` is 0, load them first."""
    rank = dist.get_rank()
    booster = Booster(plugin=GeminiPlugin(precision="fp32", placement_policy="cpu"))
    model = make_model()
    optimizer = HybridAdam(
        model.parameters(), lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=directory
    )
    model, optimizer, *_ = booster.boost(model, optimizer)
    if steps_before == 0:
        booster.load_model(model, save + "/model")
        booster.load_optimizer(optimizer, save + "/optim")
    losses = []
    for step in range(STEPS + 1):
        if step == steps_before and steps_before:
            booster.save_model(model, save + "/model", shard=True)
            booster.save_optimizer(optimizer, save + "/optim", shard=True)
            losses = []
        optimizer.zero_grad()
        loss = model(*batch_slice(step if steps_before else step + 2, 0, rank, 2))
        booster.backward(loss, optimizer)
        optimizer.step()
        losses.append(float(loss))
    return losses[: STEPS + 1 - 2]


def test_booster_checkpoints_of_state_on_the_disk_tier_resume_exactly(tmp_path: Path) -> None:
    save = str(tmp_path / "save")
    uninterrupted = run_ranks(_booster_resume, 2, str(tmp_path / "a"), save, 2)
    resumed = run_ranks(_booster_resume, 2, str(tmp_path / "b"), save, 0)
    assert resumed == uninterrupted


def _second_optimizer(closed: bool, directory: str) -> tuple[dict[str, torch.Tensor], bool]:
    """Train with one optimizer, drop it (closed, or only collected), wrap a second over the
    same model and train on. Returns the parameters and whether files are left once the
    second one is dropped too."""
    import gc

    rank = dist.get_rank()
    model = make_model()
    config = {
        "device": torch.device("cpu"),
        "chunk_size_numel": CHUNK_NUMEL,
        "placement_policy": "cpu",
        "nvme_offload_fraction": 1.0,
        "nvme_offload_dir": directory,
    }
    wrapped = zero_model_wrapper(model, 3, config)

    def train(wrapped: Any, steps: range) -> None:
        optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2))
        for step in steps:
            optimizer.zero_grad()
            optimizer.backward(wrapped(*batch_slice(step, 0, rank, 2)))
            optimizer.step()
        if closed:
            optimizer.close()

    train(wrapped, range(2))
    gc.collect()  # a collected optimizer leaves the masters on disk for the model
    train(wrapped, range(2, 4))
    params = wrapped.state_dict(only_rank_0=False)
    del wrapped, model
    gc.collect()
    return params, any(Path(directory).iterdir())


def test_an_optimizer_collected_without_close_leaves_the_masters_to_the_next(
    tmp_path: Path,
) -> None:
    closed = run_ranks(_second_optimizer, 2, True, str(tmp_path / "closed"))
    collected = run_ranks(_second_optimizer, 2, False, str(tmp_path / "collected"))
    for (a, files_a), (b, _) in zip(closed, collected, strict=True):
        assert _same(a, b)
        assert not files_a  # close() removed them (collected ones go at exit: test_disk_pool)


def _placement_log(directory: str) -> list[str]:
    messages = logged_messages("shardwise.engine.disk_tier")
    model = make_model()
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL,
                   "placement_policy": "cpu"},
    )  # fmt: skip
    zero_optim_wrapper(
        wrapped,
        HybridAdam(
            model.parameters(), lr=1e-2, nvme_offload_fraction=1.0, nvme_offload_dir=directory
        ),
    )
    return messages


def test_placing_state_on_the_disk_tier_logs_its_progress(tmp_path: Path) -> None:
    # A big model's first write of every master and state takes minutes: logged as it goes.
    messages = run_ranks(_placement_log, 2, str(tmp_path))[0]
    assert messages[0].startswith("placing ") and str(tmp_path) in messages[0], messages
    written = [m for m in messages[1:] if m.startswith("disk tier: ")]
    assert written and " of " in written[-1] and written[-1].split()[2] == written[-1].split()[4]


def _placement_bars(directory: str) -> list[str]:
    """What placing state on the disk tier drew on this rank's stderr (not a terminal)."""
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        _placement_log(directory)
    return [stderr.getvalue()]


@pytest.mark.parametrize("environment", [None, "1", "0"])
def test_placing_state_on_the_disk_tier_draws_a_bar_on_rank_0_where_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, environment: str | None
) -> None:
    # SHARDWISE_PROGRESS=1 draws rank 0's bar in a captured stderr; unset (stderr is not a
    # terminal) or 0, no bar; never one on another rank.
    if environment is None:
        monkeypatch.delenv("SHARDWISE_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("SHARDWISE_PROGRESS", environment)
    (rank_0,), (rank_1,) = run_ranks(_placement_bars, 2, str(tmp_path))
    drawn = [line for line in rank_0.split("\r") if "disk tier write" in line]
    if environment == "1":
        assert drawn and "100%" in drawn[-1], rank_0
        total = drawn[-1].split("|")[2].split()[0]  # "n/n"
        assert total.split("/")[0] == total.split("/")[1], drawn[-1]
    else:
        assert not drawn, rank_0
    assert "disk tier write" not in rank_1, rank_1
