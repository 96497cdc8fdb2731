"""Checkpoints other code reads: `state_dict_type="full"` writes one `.ckpt` from rank 0, and
`shardwise consolidate` turns a sharded checkpoint into one; `load_from_checkpoint` reads both
without shardwise. Layers rebuilt in on_load_checkpoint are sharded and loaded; a layer
replaced between Trainer calls is refused.

Two ranks train 8 steps and save both forms; a 2-epoch run resumed from the full file (its
torch-format optimizer state sliced into the shards) continues exactly as the uninterrupted
run, and Lightning's plain `ddp` resumes from it too. The weights in both files are the fp32
masters, equal bit for bit to the state the ranks hold; the two files' optimizer states are
equal bit for bit as well. The full file holds, to the bit, the weights, optimizer state,
schedulers and loops of the file Lightning's `ddp` saves after the same epoch (fp32 trains
alike), plus the loss scaler; `lightning_module_state_dict()`, as Lightning calls it, gives the
whole state on rank 0 and an empty dict on rank 1 (every rank with `rank_zero_only=False`),
or, with "sharded", each rank's shards, the whole state together.
A module whose on_load_checkpoint rebuilds a layer resumes from the full file exactly as the
uninterrupted run continues (the optimizer rebuilt over the new layer, its state sliced into
the new shards), and tests from the sharded directory with the losses of Lightning's plain
`ddp` testing the same weights.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_cases import GLOBAL_BATCH, IN, NUM_SAMPLES, Net, fit, full_state, trainer
from torch import nn
from torch.distributed._shard.sharded_tensor.api import ShardedTensor

from shardwise.cli import main as shardwise_cli
from shardwise.testing import run_ranks
from shardwise_lightning import FullyShardedStrategy, GeminiStrategy

STEPS_PER_EPOCH = 8


def _full() -> GeminiStrategy:
    return GeminiStrategy(placement_policy="cuda", chunk_size=500, state_dict_type="full")


class RebuiltOnLoad(Net):
    """The fairscale-era idiom: on_load_checkpoint replaces a layer of the sharded module."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        assert self.net is not None
        self.net[4] = nn.Linear(32, 4)


def _described(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict as plain tensors; a ShardedTensor as its global numel and its local
    shards' (offset, values)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            parts = [
                (shard.metadata.shard_offsets[0], shard.tensor.clone())
                for shard in value.local_shards()
            ]
            out[key] = ("sharded", value.size(0), parts)
        else:
            out[key] = value
    return out


def _save_and_resume(directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    continuous = fit("shardwise_gemini", max_epochs=2)
    out["continuous"] = continuous
    for name, strategy in (
        ("full", _full()),
        ("sharded", FullyShardedStrategy(state_dict_type="sharded")),
    ):
        torch.manual_seed(0)
        module = Net()
        run = trainer(strategy, max_epochs=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.fit(module)
        run.save_checkpoint(directory / f"{name}.ckpt")
        out[f"{name}_state"] = full_state(run, module)
        # Lightning's own call, without arguments: with "full" the whole state on rank 0 alone,
        # with "sharded" each rank's shards (described here: they cannot leave the process).
        out[f"{name}_default_state"] = _described(run.strategy.lightning_module_state_dict())
    # Lightning's ddp trains the same epoch and saves its own file.
    torch.manual_seed(0)
    module = Net()
    run = trainer("ddp", max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(module)
    run.save_checkpoint(directory / "ddp.ckpt")
    # Resumed from the one file, by this strategy and by Lightning's plain ddp.
    out["resumed"] = fit(_full(), max_epochs=2, ckpt_path=directory / "full.ckpt")
    out["resumed_ddp"] = fit("ddp", max_epochs=2, ckpt_path=directory / "full.ckpt")
    # A layer rebuilt in on_load_checkpoint: sharded, loaded, trained on.
    out["resumed_rebuilt"] = fit(
        _full(), RebuiltOnLoad, max_epochs=2, ckpt_path=directory / "full.ckpt"
    )
    reference = Net.load_from_checkpoint(directory / "full.ckpt", map_location="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer("ddp").test(reference, verbose=False)
        torch.manual_seed(0)
        rebuilt = RebuiltOnLoad()
        run = trainer("shardwise_gemini", max_epochs=1)
        run.fit(rebuilt)
        run.test(rebuilt, ckpt_path=directory / "sharded.ckpt", verbose=False)
        out["reference_test_losses"] = reference.test_losses
        out["rebuilt_test_losses"] = rebuilt.test_losses
        # A layer replaced between Trainer calls: refused at the next entry.
        assert rebuilt.net is not None
        rebuilt.net[0] = nn.Linear(IN, 32)
        try:
            run.predict(rebuilt)
            out["predict"] = "no error"
        except ValueError as error:
            out["predict"] = str(error)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("lightning_full")
    return directory, run_ranks(_save_and_resume, 2, directory, timeout_s=180)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def test_full_checkpoint_loads_with_load_from_checkpoint(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, ranks = saved
    file = directory / "full.ckpt"
    assert file.is_file()
    assert not list(directory.glob(".full.ckpt.shards-*"))  # the staging shards are gone
    model = Net.load_from_checkpoint(file, map_location="cpu")
    _assert_same(dict(model.state_dict()), ranks[0]["full_state"])
    raw = torch.load(file, weights_only=False)
    assert raw["global_step"] == STEPS_PER_EPOCH and raw["epoch"] == 1  # after the epoch
    assert raw["lr_schedulers"][0]["last_epoch"] == 1
    assert "shardwise_param_group_names" not in raw
    (saved_optimizer,) = raw["optimizer_states"]
    assert [len(g["params"]) for g in saved_optimizer["param_groups"]] == [6]
    first = saved_optimizer["state"][0]
    assert first["exp_avg"].shape == (32, 16)  # whole and in the parameter's shape
    assert float(first["step"]) == STEPS_PER_EPOCH


def test_full_checkpoint_holds_what_ddp_saves(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    # fp32 on 2 ranks trains bit for bit as Lightning's ddp: its file's weights, optimizer
    # state (whole tensors in each parameter's shape, numbered alike), hyper-parameters,
    # schedulers and loops are ddp's, to the bit; only the loss scaler's state is added.
    directory, _ = saved
    ours = torch.load(directory / "full.ckpt", weights_only=False)
    ddp = torch.load(directory / "ddp.ckpt", weights_only=False)
    assert set(ours) - set(ddp) == {"shardwise"}, sorted(set(ours) ^ set(ddp))
    _assert_same(ours["state_dict"], ddp["state_dict"])
    assert list(ours["state_dict"]) == list(ddp["state_dict"])
    (mine,), (theirs,) = ours["optimizer_states"], ddp["optimizer_states"]
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for number, fields in theirs["state"].items():
        assert mine["state"][number].keys() == fields.keys(), number
        for field, value in fields.items():
            assert torch.equal(mine["state"][number][field], value), (number, field)
            assert mine["state"][number][field].shape == value.shape, (number, field)
    for key in ("epoch", "global_step", "loops", "lr_schedulers"):
        assert ours[key] == ddp[key], key
    assert not list(directory.glob(".*.partial"))  # written beside the file, renamed over it


def test_lightning_module_state_dict_is_whole_on_rank_0_only(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    first, second = (result["full_default_state"] for result in saved[1])
    _assert_same(first, saved[1][0]["full_state"])
    assert second == {}
    # With rank_zero_only=False (as full_state asks) every rank gets the same whole state.
    _assert_same(saved[1][1]["full_state"], saved[1][0]["full_state"])


def test_lightning_module_state_dict_is_each_ranks_shards_when_sharded(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    # As FSDPStrategy's sharded state dict: no rank gathers the whole model, the ranks' parts
    # together are the whole state, each element held by exactly one rank.
    whole = saved[1][0]["sharded_state"]
    described = [result["sharded_default_state"] for result in saved[1]]
    assert all(d.keys() == whole.keys() for d in described)
    for key, value in whole.items():
        if not isinstance(described[0][key], tuple):  # a buffer: whole on every rank
            for d in described:
                assert torch.equal(d[key], value), key
            continue
        flat = torch.full((value.numel(),), float("nan"), dtype=value.dtype)
        covered = 0
        for d in described:
            kind, numel, parts = d[key]
            assert (kind, numel) == ("sharded", value.numel()), key
            for offset, part in parts:
                flat[offset : offset + part.numel()] = part
                covered += part.numel()
        assert covered == value.numel(), key
        assert torch.equal(flat.view(value.shape), value), key


def test_resume_from_the_full_checkpoint_continues_exactly(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    for rank, result in enumerate(saved[1]):
        continuous = result["continuous"]
        for name in ("resumed", "resumed_ddp"):
            resumed = result[name]
            assert resumed.losses == continuous.losses[STEPS_PER_EPOCH:], (rank, name)
            _assert_same(resumed.state, continuous.state)


def test_consolidate_command_output_loads_with_load_from_checkpoint(
    saved: tuple[Path, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    directory, ranks = saved
    assert (directory / "sharded.ckpt" / "manifest.json").is_file()
    with pytest.raises(IsADirectoryError):
        Net.load_from_checkpoint(directory / "sharded.ckpt")  # the problem being solved
    target = directory / "merged" / "model.ckpt"
    assert shardwise_cli(["consolidate", str(directory / "sharded.ckpt"), str(target)]) == 0
    printed = capsys.readouterr()
    assert "with optimizer state" in printed.out
    # Progress on stderr: each phase as it starts and as it ends, with its time.
    phases = [line.split(": ", 1)[1] for line in printed.err.splitlines()]
    assert [p.split(" ")[0] for p in phases] == ["checking", "checking", "reading", "reading",
                                                 "writing", "writing"], phases  # fmt: skip
    assert phases[-1].endswith(" s") and "done in" in phases[-1], phases
    model = Net.load_from_checkpoint(target, map_location="cpu")
    _assert_same(dict(model.state_dict()), ranks[0]["sharded_state"])
    merged = torch.load(target, weights_only=False)
    full = torch.load(directory / "full.ckpt", weights_only=False)
    assert merged.keys() == full.keys()
    assert merged["global_step"] == full["global_step"]
    # Both strategies trained the same numbers: the same optimizer state, field by field.
    for index, fields in full["optimizer_states"][0]["state"].items():
        for field, value in fields.items():
            assert torch.equal(merged["optimizer_states"][0]["state"][index][field], value)
    weights = directory / "weights.ckpt"
    assert (
        shardwise_cli(
            ["consolidate", "--weights-only", str(directory / "sharded.ckpt"), str(weights)]
        )
        == 0
    )
    assert "optimizer_states" not in torch.load(weights, weights_only=False)
    # Not a checkpoint: refused with the reason, no traceback.
    assert shardwise_cli(["consolidate", str(directory / "merged"), str(directory / "x.ckpt")]) == 2
    assert "no manifest.json" in capsys.readouterr().err


def test_layers_rebuilt_in_on_load_checkpoint_are_sharded_and_loaded(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    for rank, result in enumerate(saved[1]):
        continuous, resumed = result["continuous"], result["resumed_rebuilt"]
        assert resumed.losses == continuous.losses[STEPS_PER_EPOCH:], rank
        _assert_same(resumed.state, continuous.state)
        # fp32 forward of the same weights on the same samples: equal to the last bit.
        assert len(result["reference_test_losses"]) == NUM_SAMPLES // GLOBAL_BATCH
        assert result["rebuilt_test_losses"] == result["reference_test_losses"], rank


def test_a_layer_replaced_between_trainer_calls_is_refused(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    for result in saved[1]:
        message = result["predict"]
        assert "2 parameter(s) of the LightningModule are not managed" in message, message
        assert "net.0.weight, net.0.bias" in message
        assert "at the start of predict" in message
        assert "configure_model" in message
