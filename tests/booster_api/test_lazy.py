"""`shardwise.lazy.LazyInitContext`: models built without their tensors, given them when
boosted (every plugin) or by `LazyInitContext.materialize`.

Ported:
- hpcaitech/ColossalAI tests/test_lazy/test_ops.py (`test_lazy_ops`): what tensors and a
  `nn.Linear` look like inside the context, and a model deep-copied there materialising to the
  same values. Its `.cuda()` lines run as `.cpu()` (no GPU here), and its per-tensor
  `x.materialize()` (a method of ColossalAI's LazyTensor class, which has no counterpart here)
  is `LazyInitContext.materialize` of a module.
- hpcaitech/ColossalAI tests/test_lazy/test_models.py with lazy_init_utils.check_lazy_init:
  small models (the toy GPT; transformers' GPT-2, Llama and BERT) built eagerly and lazily
  have equal state dicts, `requires_grad` and outputs, a deep copy made in the context too.
  ColossalAI reseeds before every recorded op to get there; here the same seed once suffices,
  and the random stream after the build is the eager build's as well.
- hpcaitech/ColossalAI tests/test_checkpoint_io/test_gemini_checkpoint_io.py
  (`exam_lazy_from_pretrained`): `from_pretrained` inside the context, boosted by GeminiPlugin,
  holds the pretrained values (a tiny model written by `save_pretrained` stands in for
  LLAMA_PATH), sharded and safetensors or not.

Added: a lazily built model boosted by each plugin holds the eager build's values bit for bit
(ZeRO plugins initialise it module by module as they pack it); the arguments that cannot be
honoured are refused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from checkpoint_models import bert_config, gpt2_config, llama_config
from helpers import CONFIG
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    BertForPreTraining,
    GPT2LMHeadModel,
    LlamaForCausalLM,
)

from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, Plugin, TorchDDPPlugin
from shardwise.engine.model import ZeroModel
from shardwise.interface import ModelWrapper
from shardwise.lazy import LazyInitContext
from shardwise.testing import GPT, run_ranks

SEED = 42


def _gpt2() -> nn.Module:
    return GPT2LMHeadModel(gpt2_config())


def _llama() -> nn.Module:
    return LlamaForCausalLM(llama_config())


def _bert() -> nn.Module:
    return BertForPreTraining(bert_config())


MODELS: dict[str, Callable[[], nn.Module]] = {
    "toy-gpt": lambda: GPT(CONFIG),
    "gpt2": _gpt2,
    "llama": _llama,
    "bert": _bert,
}
IDS = torch.arange(16).reshape(2, 8) % 64


def _logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(IDS)
    logits: torch.Tensor = out[0]  # a tuple, or a transformers ModelOutput
    return logits


def _assert_model_equal(a: nn.Module, b: nn.Module) -> None:
    """lazy_init_utils.assert_model_equal, buffers outside the state dict included."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    for (name, x), (_, y) in zip(a.named_buffers(), b.named_buffers(), strict=True):
        assert torch.equal(x, y), name
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert p.requires_grad == q.requires_grad


def test_ported_lazy_ops() -> None:
    with LazyInitContext():
        x = torch.rand(2, 3)
        assert tuple(x.shape) == (2, 3)
        assert x.device.type == "cpu"  # where it will be, though it has no storage yet
        assert x.requires_grad is False
        y = x.cpu()
        assert y is x
        p = nn.Parameter(torch.empty(2, 3))
        assert tuple(p.shape) == (2, 3)
        assert p.device.type == "cpu"
        assert p.requires_grad is True
        assert isinstance(p, nn.Parameter)
        model = nn.Linear(3, 4)
        model = model.cpu()
        model_copied = copy.deepcopy(model)
    assert model.weight.is_meta and model_copied.bias.is_meta  # nothing allocated yet
    LazyInitContext.materialize(model)
    LazyInitContext.materialize(model_copied)
    assert model.weight.device.type == "cpu"
    assert model_copied.bias.device.type == "cpu"
    assert torch.equal(model.weight, model_copied.weight)
    assert torch.equal(model.bias, model_copied.bias)


def _tensors() -> list[torch.Tensor]:
    """Factories, random ops (over lazy inputs too), writes through views, derived tensors."""
    view_written = torch.empty(3, 4)
    view_written[:, :2].normal_()
    view_written[:, 2:].zero_()
    view_written.t()[1].mul_(3)
    return [
        torch.normal(torch.zeros(3), 1.0),
        torch.normal(0.0, 1.0, (2,)),
        torch.randint(0, 5, (4,)),
        torch.randperm(5),
        torch.bernoulli(torch.full((6,), 0.5)),
        torch.rand_like(torch.ones(2, 2)),
        torch.tensor([1.0, 2.0]).new_zeros(3),
        torch.linspace(0, 1, 5),
        torch.eye(3),
        torch.arange(6).float().reshape(2, 3)[:, 1:] * 2,
        view_written,
    ]


def test_ops_replay_as_they_ran_eagerly() -> None:
    torch.manual_seed(SEED)
    eager = _tensors()
    after = torch.get_rng_state()
    torch.manual_seed(SEED)
    with LazyInitContext():
        lazy = _tensors()
    assert torch.equal(torch.get_rng_state(), after)
    holder = nn.Module()
    for index, tensor in enumerate(lazy):
        holder.register_buffer(f"t{index}", tensor)
    LazyInitContext.materialize(holder)
    for index, (value, buffer) in enumerate(zip(eager, holder.buffers(), strict=True)):
        assert torch.equal(value, buffer), index


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ported_models_equal_their_eager_build(name: str) -> None:
    torch.manual_seed(SEED)
    eager = MODELS[name]()
    after_eager = torch.get_rng_state()
    torch.manual_seed(SEED)
    with LazyInitContext():
        lazy = MODELS[name]()
        copied = copy.deepcopy(lazy)
    assert torch.equal(torch.get_rng_state(), after_eager)  # the stream moved on as eagerly
    assert all(t.is_meta for t in [*lazy.parameters(), *lazy.buffers()])
    torch.manual_seed(SEED + 1)  # materialising draws from the states the build recorded
    state = torch.get_rng_state()
    assert LazyInitContext.materialize(lazy, verbose=True) is lazy
    LazyInitContext.materialize(copied)
    assert torch.equal(torch.get_rng_state(), state)  # and leaves the stream alone
    _assert_model_equal(eager, lazy)
    _assert_model_equal(lazy, copied)
    assert torch.equal(_logits(eager), _logits(lazy))
    assert torch.equal(_logits(lazy), _logits(copied))


PLUGINS: dict[str, Callable[[], Plugin]] = {
    "gemini": lambda: GeminiPlugin(precision="fp32"),
    "zero1": lambda: LowLevelZeroPlugin(stage=1, precision="fp32"),
    "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
    "torch-ddp": lambda: TorchDDPPlugin(),
}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, ZeroModel):
        return model.state_dict(only_rank_0=False)
    assert isinstance(model, ModelWrapper)
    return {k: v.detach().clone() for k, v in model.unwrap().state_dict().items()}


def _boost_lazily(plugin: str, model: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(SEED)
    with LazyInitContext():
        lazy = MODELS[model]()
    booster = Booster(plugin=PLUGINS[plugin]())
    optimizer = torch.optim.AdamW(lazy.parameters(), lr=1e-3)
    boosted, *_ = booster.boost(lazy, optimizer)
    return _state(boosted), _logits(boosted)


@pytest.mark.parametrize(
    ("plugin", "model"),
    [
        ("gemini", "llama"),
        ("gemini", "toy-gpt"),
        ("zero1", "gpt2"),
        ("zero2", "bert"),
        ("torch-ddp", "llama"),
    ],
)
def test_a_lazily_built_model_boosts_to_the_eager_values(plugin: str, model: str) -> None:
    torch.manual_seed(SEED)
    eager = MODELS[model]()
    expected, logits = eager.state_dict(), _logits(eager)
    for state, boosted_logits in run_ranks(_boost_lazily, 2, plugin, model):
        assert list(state) == list(expected)
        for key, value in expected.items():
            assert torch.equal(state[key], value), key
        assert torch.equal(boosted_logits, logits)  # non-persistent buffers too (rotary)


def _lora_config() -> peft.LoraConfig:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "fc"])


def _boost_lazily_with_lora() -> dict[str, torch.Tensor]:
    booster = Booster(plugin=GeminiPlugin(precision="fp32"))
    torch.manual_seed(SEED)
    with LazyInitContext():
        model = booster.enable_lora(GPT(CONFIG), lora_config=_lora_config())
    boosted, *_ = booster.boost(model)
    return _state(boosted)


def test_lora_enabled_in_the_context_boosts_to_the_eager_values() -> None:
    torch.manual_seed(SEED)
    expected = peft.get_peft_model(GPT(CONFIG), _lora_config()).state_dict()
    for state in run_ranks(_boost_lazily_with_lora, 2):
        assert list(state) == list(expected)
        for key, value in expected.items():
            assert torch.equal(state[key], value), key


def _save(model: nn.Module, directory: Path, **kwargs: Any) -> dict[str, torch.Tensor]:
    model.save_pretrained(directory, **kwargs)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _lazy_from_pretrained(directory: str) -> tuple[dict[str, torch.Tensor], bool]:
    with LazyInitContext():
        model = AutoModelForCausalLM.from_pretrained(directory)
    unallocated = all(p.is_meta for p in model.parameters())
    boosted, *_ = Booster(plugin=GeminiPlugin(precision="fp32")).boost(model)
    return _state(boosted), unallocated


@pytest.mark.parametrize(
    ("model", "save"),
    [
        ("llama", {"max_shard_size": "20KB"}),  # sharded safetensors with an index
        ("gpt2", {"safe_serialization": False}),  # pytorch_model.bin, tied head
    ],
)
def test_ported_lazy_from_pretrained_boosts_to_the_pretrained_values(
    model: str, save: dict[str, Any], tmp_path: Path
) -> None:
    torch.manual_seed(SEED)
    pretrained = MODELS[model]()
    with torch.no_grad():  # values no initialisation would give
        for param in pretrained.parameters():
            param.add_(1.0)
    expected = _save(pretrained, tmp_path, **save)
    assert list(tmp_path.glob("*.index.json")) or not save.get("max_shard_size")
    for state, unallocated in run_ranks(_lazy_from_pretrained, 2, str(tmp_path)):
        assert unallocated
        assert list(state) == list(expected)
        for key, value in expected.items():
            assert torch.equal(state[key], value), key
    # Materialised without a plugin, it is what transformers' own from_pretrained builds.
    with LazyInitContext():
        lazy = AutoModelForCausalLM.from_pretrained(tmp_path)
    LazyInitContext.materialize(lazy)
    _assert_model_equal(AutoModelForCausalLM.from_pretrained(tmp_path), lazy)
    assert not lazy.training  # eval mode, as from_pretrained leaves it


def test_lazy_from_pretrained_reads_a_torch_file_of_the_legacy_format(tmp_path: Path) -> None:
    # A pytorch_model.bin in torch's legacy (non-zip) format, as older checkpoints are: it
    # cannot be memory-mapped, and transformers' own from_pretrained reads it all the same.
    pretrained = MODELS["gpt2"]()
    pretrained.config.save_pretrained(tmp_path)
    state = pretrained.state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with LazyInitContext():
        lazy = AutoModelForCausalLM.from_pretrained(tmp_path)
    LazyInitContext.materialize(lazy)
    _assert_model_equal(AutoModelForCausalLM.from_pretrained(tmp_path), lazy)


def _reenter() -> None:
    with LazyInitContext(), LazyInitContext():
        pass


def _from_pretrained_with_device_map(directory: str) -> None:
    with LazyInitContext():
        AutoModelForCausalLM.from_pretrained(directory, device_map="auto")


def _materialize_inside() -> None:
    with LazyInitContext():
        LazyInitContext.materialize(nn.Linear(2, 2))


def _refusals(tempdir: str) -> list[str]:
    with torch.device("meta"):
        plain_meta = nn.Linear(2, 2)
    with LazyInitContext():
        half_lazy = nn.Sequential(nn.Linear(2, 2))
    half_lazy.append(plain_meta)
    attempts: list[Callable[[], Any]] = [
        lambda: LazyInitContext(tensor_cls=object),
        lambda: LazyInitContext(default_device="meta"),
        lambda: LazyInitContext(default_device=1.5),
        _reenter,
        lambda: Booster(plugin=GeminiPlugin(precision="fp32")).boost(half_lazy),
        lambda: _from_pretrained_with_device_map(tempdir),
        _materialize_inside,
    ]
    seen = []
    for attempt in attempts:
        try:
            attempt()
        except (ValueError, TypeError) as error:
            seen.append(f"{type(error).__name__}: {error}")
        else:
            seen.append("accepted")
    # Every refused context was left: tensors are real again.
    seen.append(f"after: {torch.empty(1).device}")
    return seen


def test_what_cannot_be_honoured_is_refused_with_its_fix(tmp_path: Path) -> None:
    _gpt2().save_pretrained(tmp_path)
    expected = [
        "ValueError: tensor_cls=<class 'object'> cannot be honoured",
        "ValueError: default_device='meta' cannot be honoured",
        "TypeError: default_device must be",
        "ValueError: LazyInitContext is not reentrant",
        "not built in LazyInitContext",
        "cannot honour ['device_map']",
        "inside LazyInitContext: leave the context first",
        "after: cpu",
    ]
    for seen in run_ranks(_refusals, 1, str(tmp_path)):
        assert len(seen) == len(expected), seen
        for message, part in zip(seen, expected, strict=True):
            assert part in message, (part, message)
