"""Tiny transformers models and a training step for the Booster's checkpoint tests, standing in
for ColossalAI's model zoo entries (`transformers_llama_for_causal_lm`, `transformers_gpt`,
`transformers_bert_for_sequence_classification`); dropout off so runs repeat exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, Plugin, TorchDDPPlugin
from shardwise.engine.model import ZeroModel

VOCAB = 128


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def gpt2_config() -> GPT2Config:
    """Tied input and output embeddings."""
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def bert_config() -> BertConfig:
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def llama() -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(gpt2_config())


def bert() -> nn.Module:
    torch.manual_seed(0)
    return BertForSequenceClassification(bert_config())


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": llama, "gpt2": gpt2, "bert": bert}

PLUGINS: dict[str, Callable[[], Plugin]] = {
    "gemini": lambda: GeminiPlugin(precision="fp16", initial_scale=2**14),
    "gemini-static": lambda: GeminiPlugin(
        precision="fp16",
        initial_scale=2**14,
        placement_policy="static",
        shard_param_frac=0.0,
        offload_optim_frac=0.5,
    ),
    "zero1": lambda: LowLevelZeroPlugin(stage=1, precision="fp32"),
    "zero2": lambda: LowLevelZeroPlugin(stage=2, max_norm=1.0, initial_scale=32),
    "ddp": lambda: TorchDDPPlugin(),
}


def batch(step: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return {"input_ids": torch.randint(0, VOCAB, (2, 16), generator=generator)}


def train_step(booster: Booster, model: nn.Module, optimizer: Any, step: int = 0) -> None:
    """One step with ColossalAI's test criterion, the mean of the first output."""
    output = model(**batch(step))
    first = output.logits if hasattr(output, "logits") else output[0]
    booster.backward(first.float().mean(), optimizer)
    optimizer.step()
    optimizer.zero_grad()


def whole_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The boosted model's weights, whole, as fp32 on CPU (every rank)."""
    if isinstance(model, ZeroModel):
        state = model.state_dict(only_rank_0=False)
    else:
        state = model.unwrap().state_dict()  # type: ignore[operator]
    return {k: v.detach().float().cpu() for k, v in state.items()}


def whole_optimizer_state(optimizer: Any) -> dict[str, Any]:
    """The boosted optimizer's torch state dict, whole (every rank)."""
    if hasattr(optimizer, "engine"):
        state: dict[str, Any] = optimizer.state_dict(only_rank_0=False)
        return state
    return dict(optimizer.unwrap().state_dict())


def assert_states_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """ColossalAI's `check_state_dict_equal`, exact: same keys, equal values (dtype aside)."""
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:5]
    for key in a:
        left, right = a[key], b[key]
        if isinstance(left, dict):
            assert_states_equal(left, right)
        elif isinstance(left, torch.Tensor):
            assert torch.equal(left.float().cpu(), right.float().cpu()), key
        else:
            assert left == right, key


def assert_optimizer_states_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Per-parameter state equal; the groups' hyper-parameters that both optimizers have
    (HybridAdam and torch's Adam differ in their implementation flags)."""
    assert_states_equal(
        {str(k): v for k, v in a["state"].items()}, {str(k): v for k, v in b["state"].items()}
    )
    for left, right in zip(a["param_groups"], b["param_groups"], strict=True):
        for key in ("params", "lr", "betas", "eps", "weight_decay"):
            assert left[key] == right[key], key
