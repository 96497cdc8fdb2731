"""Booster checkpoints, ported from ColossalAI (hpcaitech/ColossalAI, tests/test_checkpoint_io/):

- test_gemini_checkpoint_io.py: `exam_state_dict_with_origin` (a sharded save that
  transformers' `from_pretrained` reads) and `exam_state_dict` (model and optimizer saved,
  sharded and whole, loaded into a fresh boosted pair: equal states, the saved learning rate,
  and the pair trains on);
- test_low_level_zero_checkpoint_io.py and test_torch_ddp_checkpoint_io.py: the same round trip
  with LowLevelZeroPlugin and TorchDDPPlugin;
- test_gemini_torch_compability.py: a Gemini checkpoint loaded by TorchDDPPlugin with torch's
  Adam, and back; the boosted Gemini optimizer's `state_dict()` has exactly torch's keys
  (`state`, `param_groups`: the original's `check_state_dict_equal` counts them), equal to
  torch's Adam's after it loaded them, groups included (HybridAdam's carry torch's Adam keys
  beside `bias_correction`, as ColossalAI's);
- test_plugins_huggingface_compatibility.py: every plugin's sharded save read by
  `from_pretrained`, boosted again to the same state.

CPU and gloo instead of CUDA and NCCL; tiny transformers models (checkpoint_models.py) instead
of the model zoo's; 2 ranks. Beyond the originals: every rank writes its own files; a
checkpoint loads at another world size and into another plugin or stage; `save_pretrained`'s
own shard names load; a failed write leaves the previous checkpoint and raises on every rank;
a model compiled whole saves under its own names; `checkpoint.export_hf` writes the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checkpoint_models import (
    MODELS,
    PLUGINS,
    assert_optimizer_states_equal,
    assert_states_equal,
    train_step,
    whole_optimizer_state,
    whole_state,
)
from torch.optim import Adam

from shardwise import zero_model_wrapper
from shardwise.booster import Booster
from shardwise.checkpoint import CheckpointError, export_hf
from shardwise.checkpoint.file_plan import plan_files
from shardwise.checkpoint.file_writer import FileWriter
from shardwise.nn.optimizer import HybridAdam
from shardwise.testing import run_ranks


def _boosted(plugin: str, model: str, lr: float = 1e-3, torch_adam: bool = False) -> Any:
    booster = Booster(plugin=PLUGINS[plugin]())
    module = MODELS[model]()
    optimizer = (Adam if torch_adam else HybridAdam)(module.parameters(), lr=lr)
    boosted_model, boosted_optimizer, *_ = booster.boost(module, optimizer)
    return booster, boosted_model, boosted_optimizer


def _record_writers(monkeypatch_target: list[str]) -> None:
    """Record the names of the files this rank writes."""
    original = FileWriter._write

    def recording(self: FileWriter, number: int) -> None:
        monkeypatch_target.append(self.plan.names[number])
        original(self, number)

    FileWriter._write = recording  # type: ignore[method-assign]


def _from_pretrained_run(plugin: str, root: Path, use_safetensors: bool) -> list[str]:
    booster, model, optimizer = _boosted(plugin, "llama")
    train_step(booster, model, optimizer)
    written: list[str] = []
    _record_writers(written)
    target = root / "model"
    booster.save_model(
        model, str(target), shard=True, size_per_shard=0.02, use_safetensors=use_safetensors
    )
    saved = whole_state(model)
    loaded = type(MODELS["llama"]()).from_pretrained(str(target))
    assert_states_equal(saved, {k: v for k, v in loaded.state_dict().items()})
    again, *_ = Booster(plugin=PLUGINS[plugin]()).boost(loaded, HybridAdam(loaded.parameters()))
    assert_states_equal(saved, whole_state(again))
    return written


@pytest.mark.parametrize("plugin", ["gemini", "zero2", "ddp"])
def test_sharded_save_is_read_by_from_pretrained(plugin: str, tmp_path: Path) -> None:
    # test_plugins_huggingface_compatibility.py::exam_from_pretrained (size_per_shard small
    # enough for several files) and test_gemini_checkpoint_io.py::exam_state_dict_with_origin.
    use_safetensors = plugin != "zero2"
    written = run_ranks(_from_pretrained_run, 2, plugin, tmp_path, use_safetensors)
    index_name = "model.safetensors" if use_safetensors else "pytorch_model.bin"
    index = json.loads((tmp_path / "model" / f"{index_name}.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    # Each rank wrote files of its own, together every file once.
    assert all(written) and sorted(written[0] + written[1]) == files
    assert (tmp_path / "model" / "config.json").is_file()
    suffix = "safetensors" if use_safetensors else "bin"
    stem = "model" if use_safetensors else "pytorch_model"
    assert files[0] == f"{stem}-00001.{suffix}"


def _round_trip_run(plugin: str, root: Path, shard: bool) -> None:
    booster, model, optimizer = _boosted(plugin, "llama", lr=1e-3)
    _, new_model, new_optimizer = _boosted(plugin, "llama", lr=1e-2)
    train_step(booster, model, optimizer)
    for group in optimizer.param_groups:
        group["lr"] = 0.1
    model_path, optimizer_path = root / "model", root / "optimizer"
    if not shard:
        model_path, optimizer_path = root / "model.bin", root / "optimizer.bin"
    booster.save_model(model, str(model_path), shard=shard, size_per_shard=0.02)
    booster.save_optimizer(optimizer, str(optimizer_path), shard=shard, size_per_shard=0.02)
    booster.load_model(new_model, str(model_path))
    assert_states_equal(whole_state(model), whole_state(new_model))
    booster.load_optimizer(new_optimizer, str(optimizer_path))
    assert_optimizer_states_equal(
        whole_optimizer_state(optimizer), whole_optimizer_state(new_optimizer)
    )
    assert all(group["lr"] == 0.1 for group in new_optimizer.param_groups)
    # Both pairs go on identically: the loaded state is all the next step needs.
    train_step(booster, model, optimizer, step=1)
    train_step(booster, new_model, new_optimizer, step=1)
    assert_states_equal(whole_state(model), whole_state(new_model))


@pytest.mark.parametrize("plugin", ["gemini", "gemini-static", "zero1", "zero2", "ddp"])
@pytest.mark.parametrize("shard", [True, False])
def test_model_and_optimizer_round_trip(plugin: str, shard: bool, tmp_path: Path) -> None:
    # test_gemini_checkpoint_io.py::exam_state_dict, test_low_level_zero_checkpoint_io.py,
    # test_torch_ddp_checkpoint_io.py.
    run_ranks(_round_trip_run, 2, plugin, tmp_path, shard)


def _across_plugins_run(source: str, target: str, root: Path, shard: bool) -> None:
    booster, model, optimizer = _boosted(source, "gpt2", torch_adam=source == "ddp")
    train_step(booster, model, optimizer)
    booster.save_model(model, str(root / "model"), shard=shard)
    booster.save_optimizer(optimizer, str(root / "optim"), shard=shard)
    new_booster, new_model, new_optimizer = _boosted(target, "gpt2", torch_adam=target == "ddp")
    new_booster.load_model(new_model, str(root / "model"), strict=True)
    assert_states_equal(whole_state(model), whole_state(new_model))
    new_booster.load_optimizer(new_optimizer, str(root / "optim"))
    old_state, new_state = whole_optimizer_state(optimizer), whole_optimizer_state(new_optimizer)
    assert sorted(old_state) == sorted(new_state) == ["param_groups", "state"]
    gemini_state = old_state if source == "gemini" else new_state
    assert all(group["bias_correction"] is True for group in gemini_state["param_groups"])
    assert_optimizer_states_equal(old_state, new_state)
    if source == "gemini":
        # The original's check_state_dict_equal over the whole dict: HybridAdam's groups carry
        # torch's Adam keys (as get_param_groups_for_saving), so Adam gives back equal groups.
        assert old_state["param_groups"] == new_state["param_groups"]
    train_step(new_booster, new_model, new_optimizer, step=1)


@pytest.mark.parametrize(("source", "target"), [("gemini", "ddp"), ("ddp", "gemini")])
@pytest.mark.parametrize("shard", [False, True])
def test_gemini_and_torch_adam_load_each_other(
    source: str, target: str, shard: bool, tmp_path: Path
) -> None:
    # test_gemini_torch_compability.py: exam_torch_load_from_gemini, exam_gemini_load_from_torch
    # (HybridAdam's state into torch's Adam and back; gpt2 has tied embeddings).
    run_ranks(_across_plugins_run, 2, source, target, tmp_path / source, shard)


def _save_run(plugin: str, root: Path) -> dict[str, Any]:
    booster, model, optimizer = _boosted(plugin, "gpt2")
    train_step(booster, model, optimizer)
    booster.save_model(model, str(root / "model"), shard=True, size_per_shard=0.02)
    booster.save_optimizer(optimizer, str(root / "optim"), shard=True, size_per_shard=0.02)
    return {"model": whole_state(model), "optim": whole_optimizer_state(optimizer)}


def _load_run(plugin: str, root: Path) -> dict[str, Any]:
    booster, model, optimizer = _boosted(plugin, "gpt2")
    booster.load_model(model, str(root / "model"))
    booster.load_optimizer(optimizer, str(root / "optim"))
    return {"model": whole_state(model), "optim": whole_optimizer_state(optimizer)}


def test_a_checkpoint_loads_at_another_world_size_plugin_and_stage(tmp_path: Path) -> None:
    saved = run_ranks(_save_run, 2, "gemini", tmp_path)[0]
    for plugin, world in (("gemini", 4), ("zero1", 4), ("zero2", 1)):
        for loaded in run_ranks(_load_run, world, plugin, tmp_path):
            assert_states_equal(saved["model"], loaded["model"])
            assert_optimizer_states_equal(saved["optim"], loaded["optim"])


def _save_pretrained_run(root: Path) -> None:
    booster, model, _ = _boosted("gemini", "llama")
    booster.load_model(model, str(root))
    assert_states_equal(
        {k: v.float() for k, v in MODELS["llama"]().state_dict().items()}, whole_state(model)
    )


def test_save_pretrained_shards_load_into_a_boosted_model(tmp_path: Path) -> None:
    # Hugging Face's own names: model-00001-of-0000N.safetensors and its index.
    MODELS["llama"]().save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    run_ranks(_save_pretrained_run, 2, tmp_path)


def _compiled_run(plugin: str, root: Path) -> None:
    # torch.compile(model), as nanoGPT and torch's tutorials compile: the wrapper's state dict
    # puts `_orig_mod.` before every key. The checkpoint holds the model's own names, so
    # from_pretrained, the model run uncompiled and the model compiled again all read it.
    booster = Booster(plugin=PLUGINS[plugin]())
    compiled = torch.compile(MODELS["llama"](), backend="eager")
    model, optimizer, *_ = booster.boost(compiled, HybridAdam(compiled.parameters(), lr=1e-3))
    train_step(booster, model, optimizer)
    booster.save_model(
        model, str(root / "compiled"), shard=True, size_per_shard=0.02, use_safetensors=True
    )
    booster.save_optimizer(optimizer, str(root / "optim"), shard=True, size_per_shard=0.02)
    saved = _without_compile_prefix(whole_state(model))
    loaded = type(MODELS["llama"]()).from_pretrained(str(root / "compiled"))
    assert_states_equal(saved, dict(loaded.state_dict()))
    _, plain, plain_optimizer = _boosted(plugin, "llama")
    booster.load_model(plain, str(root / "compiled"))
    booster.load_optimizer(plain_optimizer, str(root / "optim"))
    assert_states_equal(saved, whole_state(plain))
    assert_optimizer_states_equal(
        whole_optimizer_state(optimizer), whole_optimizer_state(plain_optimizer)
    )
    # And back: the uncompiled model's checkpoint loads into the compiled one.
    train_step(booster, plain, plain_optimizer, step=1)
    booster.save_model(plain, str(root / "plain"), shard=True, size_per_shard=0.02)
    booster.load_model(model, str(root / "plain"))
    assert_states_equal(whole_state(plain), _without_compile_prefix(whole_state(model)))


def _without_compile_prefix(state: dict[str, Any]) -> dict[str, Any]:
    return {key.removeprefix("_orig_mod."): value for key, value in state.items()}


@pytest.mark.parametrize("plugin", ["gemini", "ddp"])
def test_a_model_compiled_whole_saves_and_loads_under_its_own_names(
    plugin: str, tmp_path: Path
) -> None:
    run_ranks(_compiled_run, 2, plugin, tmp_path)


def _failing_run(root: Path) -> str:
    booster, model, optimizer = _boosted("gemini", "llama")
    booster.save_model(model, str(root), shard=True, size_per_shard=0.02)
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    if dist.get_rank() == 1:
        original = FileWriter._write

        def full_disk(self: FileWriter, number: int) -> None:
            self.write_file = lambda contents, path: (_ for _ in ()).throw(OSError("disk full"))
            original(self, number)

        FileWriter._write = full_disk  # type: ignore[method-assign]
    train_step(booster, model, optimizer)
    with pytest.raises(CheckpointError, match="disk full") as raised:
        booster.save_model(model, str(root), shard=True, size_per_shard=0.02)
    after = {p.name: p.read_bytes() for p in root.iterdir()}
    assert sorted(after) == sorted(before)
    assert after == before, [k for k in after if after[k] != before[k]]
    return str(raised.value)


def test_a_failed_write_raises_on_every_rank_and_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    messages = run_ranks(_failing_run, 2, tmp_path / "model")
    assert messages[0] == messages[1] and "rank 1" in messages[0]


def _refusals_run(root: Path) -> None:
    booster, model, optimizer = _boosted("gemini", "llama")
    with pytest.raises(ValueError, match="safetensors"):
        booster.save_model(model, str(root / "model.bin"), use_safetensors=True)
    with pytest.raises(ValueError, match="size_per_shard"):
        booster.save_model(model, str(root / "m"), shard=True, size_per_shard=0)
    with pytest.raises(CheckpointError, match="does not exist"):
        booster.load_model(model, str(root / "nowhere"))
    _, other, _ = _boosted("gemini", "gpt2")
    booster.save_model(other, str(root / "gpt2"), shard=True)
    with pytest.raises(CheckpointError, match="does not match the model"):
        booster.load_model(model, str(root / "gpt2"))
    booster.save_optimizer(optimizer, str(root / "optim"), shard=True)
    with pytest.raises(CheckpointError, match="optimizer"):
        booster.load_model(model, str(root / "optim"))


def test_bad_checkpoint_arguments_are_refused(tmp_path: Path) -> None:
    run_ranks(_refusals_run, 2, tmp_path)


def test_every_file_is_written_whole_by_one_rank() -> None:
    sizes = [(f"w{i}", 10) for i in range(10)]
    plan = plan_files(sizes, max_file_bytes=25, world_size=3, shard_name="pytorch_model.bin")
    assert plan.files == (("w0", "w1"), ("w2", "w3"), ("w4", "w5"), ("w6", "w7"), ("w8", "w9"))
    assert plan.names[0] == "pytorch_model-00001.bin"
    assert plan.writers == (0, 0, 1, 2, 2)
    assert plan.file_of()["w9"] == "pytorch_model-00005.bin"
    # Under a limit above the whole: a file per rank, so no rank holds every tensor.
    spread = plan_files(sizes, max_file_bytes=10**9, world_size=2, shard_name="m.bin")
    assert spread.files == (("w0", "w1", "w2", "w3", "w4"), ("w5", "w6", "w7", "w8", "w9"))
    assert spread.writers == (0, 1)
    # A key bigger than the limit gets a file of its own.
    alone = plan_files(
        [("big", 100), ("small", 1)], max_file_bytes=10, world_size=2, shard_name="m.bin"
    )
    assert alone.files == (("big",), ("small",))
    with pytest.raises(ValueError, match="positive"):
        plan_files(sizes, max_file_bytes=0, world_size=1, shard_name="m.bin")


def _export_hf_run(root: Path) -> dict[str, Any]:
    module = MODELS["gpt2"]()
    wrapped = zero_model_wrapper(module, 3, {"device": torch.device("cpu")})
    export_hf(root, wrapped)
    return {k: v.float() for k, v in wrapped.state_dict(only_rank_0=False).items()}


def test_export_hf_of_a_tied_model_is_read_by_from_pretrained(tmp_path: Path) -> None:
    # checkpoint.export_hf writes as save_pretrained does (the tied head once, config.json),
    # every rank some of the files.
    exported = run_ranks(_export_hf_run, 2, tmp_path)[0]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert len(set(index["weight_map"].values())) >= 2
    loaded = type(MODELS["gpt2"]()).from_pretrained(str(tmp_path))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert_states_equal(exported, dict(loaded.state_dict()))
