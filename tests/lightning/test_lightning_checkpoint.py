"""trainer.save_checkpoint / fit(ckpt_path=...) through the engine's sharded checkpoint.

A run saved after one epoch and resumed for a second continues exactly as the uninterrupted
run did at the same world size (bit for bit: fp32 masters, Adam moments, scheduler and loop
state are restored as they were). Resumed at 1 rank instead of 2, each step sees the same
global batch, but the mean loss over 8 samples is one sum instead of the average of two
4-sample means and the gradients add in another order: the losses agree to 1e-6, parameters
to 1e-5 (Adam magnifies last-bit gradient differences near zero, still far below one step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_cases import FitResult, Net, fit, full_state, trainer

from shardwise.cli import main as shardwise_cli
from shardwise.testing import run_ranks
from shardwise_lightning import FullyShardedStrategy, GeminiStrategy

STEPS_PER_EPOCH = 8  # 64 samples, global batch 8


def _gemini() -> GeminiStrategy:
    return GeminiStrategy(placement_policy="cuda", chunk_size=500, state_dict_type="sharded")


def _two_ranks(directory: Path) -> dict[str, Any]:
    continuous = fit(_gemini(), max_epochs=2)
    torch.manual_seed(0)
    module = Net()
    first = trainer(_gemini(), max_epochs=1)
    first.fit(module)
    first.save_checkpoint(directory / "epoch1.ckpt")
    first_state = full_state(first, module)
    switched = _save_both_forms_under_one_name(first, directory)
    # The module holds its whole weights after fit: weights changed there are what a sharded
    # save writes.
    with torch.no_grad():
        for param in module.parameters():
            param.add_(1.0)
    first.save_checkpoint(directory / "changed.ckpt")
    # Another chunk size and the other strategy: the checkpoint is layout independent.
    resumed = fit(
        FullyShardedStrategy(min_num_params=700), max_epochs=2, ckpt_path=directory / "epoch1.ckpt"
    )
    return {"continuous": continuous, "resumed": resumed, "first_state": first_state, **switched}


def _save_both_forms_under_one_name(run: Any, directory: Path) -> dict[str, Any]:
    """A sharded checkpoint, a full one over it, a sharded one over that, as a run resumed
    with the other state_dict_type does to ModelCheckpoint's last.ckpt; then a full one at an
    ordinary directory, refused on every rank."""
    path = directory / "last.ckpt"
    strategy = run.strategy
    run.save_checkpoint(path)
    sharded_dir = path.resolve()
    strategy.state_dict_type = "full"
    run.save_checkpoint(path)
    full = {"is_file": path.is_file() and not path.is_symlink()}
    if full["is_file"]:
        full["weights"] = torch.load(path, weights_only=False)["state_dict"]
    full["old_directory_left"] = sharded_dir.exists()
    strategy.barrier()  # every rank read the file before it is replaced
    strategy.state_dict_type = "sharded"
    run.save_checkpoint(path)
    ordinary = directory / "outputs"
    if strategy.is_global_zero:
        ordinary.mkdir()
    strategy.barrier()
    strategy.state_dict_type = "full"
    try:
        run.save_checkpoint(ordinary)
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    strategy.state_dict_type = "sharded"
    return {"full_over_sharded": full, "refused": refused}


def _one_rank(directory: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    module = Net()
    run = trainer("shardwise_gemini", max_epochs=2)
    run.fit(module, ckpt_path=directory / "epoch1.ckpt")
    optimizer = run.strategy.zero_optimizer()  # type: ignore[attr-defined]
    return {
        "losses": module.losses,
        "state": full_state(run, module),
        "global_step": run.global_step,
        "lr": optimizer.param_groups[0]["lr"],
        "rank0_only": run.strategy.lightning_module_state_dict(rank_zero_only=True),  # type: ignore[attr-defined]
    }


def test_resume_at_two_and_one_ranks(tmp_path: Path) -> None:
    two = run_ranks(_two_ranks, 2, tmp_path, timeout_s=120)
    manifest = json.loads((tmp_path / "epoch1.ckpt" / "manifest.json").read_text())
    assert manifest["saved_world_size"] == 2 and manifest["has_optimizer"]
    for rank, result in enumerate(two):
        continuous: FitResult = result["continuous"]
        resumed: FitResult = result["resumed"]
        assert len(continuous.losses) == 2 * STEPS_PER_EPOCH
        assert resumed.losses == continuous.losses[STEPS_PER_EPOCH:], rank
        for key, value in continuous.state.items():
            assert torch.equal(resumed.state[key], value), key
        assert any(
            not torch.equal(result["first_state"][k], v) for k, v in continuous.state.items()
        )  # the second epoch changed the weights

    for result in two:
        # Each form took the other's place under one name, leaving nothing of the old one.
        full = result["full_over_sharded"]
        assert full["is_file"] and not full["old_directory_left"], full
        for key, value in result["first_state"].items():
            assert torch.equal(full["weights"][key], value), key
        assert "outputs: it is an ordinary directory" in result["refused"], result["refused"]
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() and (last / "manifest.json").is_file()
    assert len(list(tmp_path.glob("last.ckpt*"))) == 2  # the link and the version it names
    assert list((tmp_path / "outputs").iterdir()) == []
    changed = tmp_path / "changed.pt"
    assert (
        shardwise_cli(
            ["consolidate", "--weights-only", str(tmp_path / "changed.ckpt"), str(changed)]
        )
        == 0
    )
    weights = torch.load(changed, weights_only=False)["state_dict"]
    for key, value in two[0]["first_state"].items():
        assert torch.equal(weights[key], value + 1.0), key

    one = run_ranks(_one_rank, 1, tmp_path, timeout_s=60)[0]
    assert one["global_step"] == 2 * STEPS_PER_EPOCH
    # StepLR(step_size=3) stepped twice (once per epoch) in both: not yet decayed.
    assert one["lr"] == pytest.approx(1e-2)
    # The global mean loss per step of the 2-rank run is the mean of its ranks' losses.
    two_rank_loss = [
        (a + b) / 2 for a, b in zip(two[0]["resumed"].losses, two[1]["resumed"].losses, strict=True)
    ]
    assert one["losses"] == pytest.approx(two_rank_loss, abs=1e-6)
    reference = two[0]["continuous"].state
    for key, value in one["state"].items():
        assert torch.allclose(value, reference[key], rtol=0, atol=1e-5), key
    assert one["rank0_only"].keys() == reference.keys()
