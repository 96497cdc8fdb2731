"""The Booster with each data-parallel plugin, written as ColossalAI 0.5's training loop is
(`booster.boost`, `booster.backward`, `optimizer.step`, `booster.no_sync`), against a plain
torch loop over the same global batch (helpers.reference: gradients averaged over the ranks'
slices, `.grad` None where nothing flowed, torch's `clip_grad_norm_`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import Run, adamw, batch_slice, make_model, max_abs_diff, reference
from torch.utils.data import TensorDataset

from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, Plugin, TorchDDPPlugin
from shardwise.checkpoint import CheckpointError
from shardwise.interface import ModelWrapper
from shardwise.testing import run_ranks

# Clipping and accumulation: the same sums in another order than the plain loop's.
PARAM_TOL = 1e-4
PLUGINS: dict[str, Callable[..., Plugin]] = {
    "gemini": lambda **kw: GeminiPlugin(precision="fp32", **kw),
    "gemini-cuda-placement": lambda **kw: GeminiPlugin(
        precision="fp32", placement_policy="cuda", max_prefetch=1, **kw
    ),
    "zero1": lambda **kw: LowLevelZeroPlugin(stage=1, precision="fp32", **kw),
    "zero2": lambda **kw: LowLevelZeroPlugin(stage=2, precision="fp32", **kw),
    # ColossalAI's cpu_offload: masters, gradients and optimizer state in host memory.
    "zero1-cpu-offload": lambda **kw: LowLevelZeroPlugin(
        stage=1, precision="fp32", cpu_offload=True, **kw
    ),
    "zero2-cpu-offload": lambda **kw: LowLevelZeroPlugin(
        stage=2, precision="fp32", cpu_offload=True, **kw
    ),
    "torch-ddp": lambda **kw: TorchDDPPlugin(find_unused_parameters=True, **kw),
}


def _boosted_run(
    name: str, run: Run, clip_each_step: float = 0.0, compiled: bool = False, **plugin_args: Any
) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank = dist.get_rank()
    booster = Booster(plugin=PLUGINS[name](**plugin_args))
    model = make_model()
    if compiled:  # each block compiled before boosting, as torchtitan and ColossalAI users do
        for block in model.gpt.blocks:
            block.compile(backend="aot_eager")
    optimizer = adamw(model.parameters())
    model, optimizer, _, _, _ = booster.boost(model, optimizer)
    losses = []
    for step in range(run.steps):
        optimizer.zero_grad()
        step_loss = torch.zeros(())
        for micro in range(run.accum):
            loss = model(*batch_slice(step, micro, rank, run.world)) / run.accum
            if micro < run.accum - 1:
                with booster.no_sync(model, optimizer):
                    booster.backward(loss, optimizer)
            else:
                booster.backward(loss, optimizer)
            step_loss += loss.detach().float()
        if clip_each_step:
            optimizer.clip_grad_by_norm(clip_each_step)
        optimizer.step()
        dist.all_reduce(step_loss)
        losses.append(float(step_loss / run.world))
    if isinstance(model, ModelWrapper):  # TorchDDPPlugin
        state = model.unwrap().state_dict()
    else:
        state = model.state_dict(only_rank_0=False)
    return losses, {k: v.detach().cpu().float() for k, v in state.items()}


@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_each_plugin_trains_as_the_plain_loop_bit_for_bit(name: str) -> None:
    run = Run(steps=3)
    ref_losses, ref_state = reference(run)
    for losses, state in run_ranks(_boosted_run, 2, name, run):
        assert losses == ref_losses
        assert max_abs_diff(state, ref_state) == 0.0
    assert ref_losses[-1] < ref_losses[0]


def test_a_compiled_model_trains_as_compiled_ddp_bit_for_bit() -> None:
    # aot_eager: dynamo's capture and AOTAutograd's graphs, eager's kernels (see
    # tests/test_compile.py), so both sides compute the same sums in the same order.
    run = Run(steps=3)
    ddp_losses, ddp_state = run_ranks(_boosted_run, 2, "torch-ddp", run, compiled=True)[0]
    for name in ("gemini", "zero2"):
        for losses, state in run_ranks(_boosted_run, 2, name, run, compiled=True):
            assert losses == ddp_losses, name
            assert max_abs_diff(state, ddp_state) == 0.0, name
    assert ddp_losses[-1] < ddp_losses[0]


@pytest.mark.parametrize("name", ["gemini", "zero2", "torch-ddp"])
def test_no_sync_accumulates_as_the_plain_loop_at_every_plugin(name: str) -> None:
    # Each rank sums its micro-batches before the ranks' sums are added; the plain loop adds
    # the four gradients one after another: the same sum in another order (as test_parity's
    # accumulation tests, within PARAM_TOL after Adam).
    run = Run(steps=2, accum=2)
    ref_losses, ref_state = reference(run)
    for losses, state in run_ranks(_boosted_run, 2, name, run):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert max_abs_diff(state, ref_state) < PARAM_TOL


@pytest.mark.parametrize("name", ["gemini", "zero1"])
def test_clipping_by_the_plugin_and_by_clip_grad_by_norm(name: str) -> None:
    run = Run(steps=3, max_norm=0.5)
    ref_losses, ref_state = reference(run)
    by_plugin = run_ranks(_boosted_run, 2, name, run, max_norm=0.5)
    by_call = run_ranks(_boosted_run, 2, name, run, clip_each_step=0.5)
    for losses, state in by_plugin + by_call:
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert max_abs_diff(state, ref_state) < PARAM_TOL


def _refusals() -> list[str]:
    seen = []
    attempts: list[Callable[[], object]] = [
        lambda: GeminiPlugin(tp_size=2),
        lambda: GeminiPlugin(use_fp8=True),
        lambda: GeminiPlugin(precision="fp8"),
        lambda: GeminiPlugin(placement_policy="nvme"),
        lambda: GeminiPlugin(master_weights=False),
        lambda: LowLevelZeroPlugin(stage=3),
        lambda: TorchDDPPlugin(fp8_communication=True),
        lambda: Booster(),
        lambda: Booster(mixed_precision="fp16_apex", plugin=TorchDDPPlugin()),
    ]
    for attempt in attempts:
        try:
            attempt()
        except ValueError as error:
            seen.append(str(error))
        else:
            seen.append("accepted")
    return seen


def test_what_cannot_be_honoured_is_refused_with_its_fix() -> None:
    seen = run_ranks(_refusals, 2)[0]
    expected = [
        "tp_size=2",
        "use_fp8=True",
        "precision must be one of",
        "placement_policy must be one of",
        "master_weights=False cannot be honoured",
        "stage must be 1 or 2",
        "fp8_communication=True",
        "Booster needs a plugin",
        "mixed_precision='fp16_apex' is not offered: use 'fp16'",
    ]
    assert len(seen) == len(expected)
    for message, part in zip(seen, expected, strict=True):
        assert part in message, (part, message)


def _loaded_indices() -> list[list[int]]:
    plugin = LowLevelZeroPlugin(precision="fp32")
    dataset = TensorDataset(torch.arange(10))
    loader = plugin.prepare_dataloader(dataset, batch_size=2, shuffle=True, seed=7)
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        epochs.append([int(i) for (batch,) in loader for i in batch])
    return epochs


def test_prepare_dataloader_gives_each_rank_its_share() -> None:
    first, second = run_ranks(_loaded_indices, 2)
    for epoch in range(2):
        assert sorted(first[epoch] + second[epoch]) == list(range(10))  # disjoint, complete
    assert first[0] != first[1]  # shuffled anew each epoch


def _scheduler_round_trip(path: str) -> tuple[list[float], list[float], bool]:
    booster = Booster(plugin=LowLevelZeroPlugin(precision="fp32"))
    model = make_model()
    optimizer = adamw(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    for _ in range(3):
        optimizer.step()  # no gradients yet: the step changes nothing, the schedule moves on
        scheduler.step()
    booster.save_lr_scheduler(scheduler, path)
    fresh = torch.optim.lr_scheduler.StepLR(adamw(make_model().parameters()), 2, gamma=0.5)
    booster.load_lr_scheduler(fresh, path)
    directory_refused = False
    try:
        booster.save_lr_scheduler(scheduler, str(Path(path).parent))
    except CheckpointError as error:
        directory_refused = "is a directory" in str(error)
    return scheduler.get_last_lr(), fresh.get_last_lr(), directory_refused


def test_the_lr_scheduler_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.pt"
    for saved, loaded, directory_refused in run_ranks(_scheduler_round_trip, 2, str(path)):
        assert saved == loaded == [1e-2 * 0.5]  # three steps of a step-2 schedule
        assert directory_refused  # on every rank: rank 0's failure reached rank 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scheduler.pt"]  # no partial file
