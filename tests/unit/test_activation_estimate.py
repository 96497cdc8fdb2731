"""The planner's activation estimate (see [Note: estimating activations] in
planner/activations.py): the bytes autograd saves for backward, counted once per storage,
parameters and inputs left out; on the meta device (nothing allocated) the same figure as a
real forward of the same shapes on this host, attention counted as fused kernels keep it;
activation checkpointing seen as it runs, its largest region's recomputation beside it."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.planner import estimate_activation_bytes
from shardwise.testing import GPT, GPTConfig, gpt_batch


def test_a_small_mlp_saves_what_autograd_keeps_and_nothing_else() -> None:
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    estimate = estimate_activation_bytes(mlp, torch.randn(16, 4))
    # ReLU's output (16 x 8 fp32), which the second Linear saves too: one storage. The input
    # and the weights are saved as well, and are not activations.
    assert estimate.saved_bytes == 16 * 8 * 4
    assert estimate.output_bytes == 16 * 2 * 4
    assert estimate.total_bytes == 16 * 8 * 4 + 2 * 16 * 2 * 4


def test_the_meta_device_gives_the_real_forwards_figure() -> None:
    config = GPTConfig(vocab_size=512, block_size=64, n_layer=3, n_head=4, n_embd=128)
    torch.manual_seed(0)
    real = GPT(config)
    idx, targets = gpt_batch(config, 4, 64, 0)
    with torch.device("meta"):
        meta = GPT(config)
    measured = estimate_activation_bytes(real, idx, targets)
    estimated = estimate_activation_bytes(meta, idx.to("meta"), targets.to("meta"))
    assert estimated == measured
    # Attention's reference path keeps each layer's attention matrix (4 x 4 x 64 x 64 fp32)
    # where the fused kernels keep a log-sum-exp per row (4 x 4 x 64); the estimate counts
    # the kernels'.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        reference_path = estimate_activation_bytes(real, idx, targets)
    matrices, rows = 3 * 4 * 4 * 64 * 64 * 4, 3 * 4 * 4 * 64 * 4
    assert reference_path.saved_bytes - measured.saved_bytes == matrices - rows


def test_a_hugging_face_llama_with_and_without_checkpointing() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
    )
    causal = torch.zeros(2, 1, 32, 32).masked_fill(
        torch.ones(32, 32, dtype=torch.bool).triu(1), float("-inf")
    )
    ids = torch.randint(0, 500, (2, 32))
    torch.manual_seed(0)
    real = LlamaForCausalLM(config).train()
    with torch.device("meta"):
        meta = LlamaForCausalLM(config).train()

    def inputs(device: str) -> dict[str, torch.Tensor]:
        # A 4-D mask: Hugging Face's own mask preparation reads values, which meta has not.
        return {
            "input_ids": ids.to(device),
            "labels": ids.to(device),
            "attention_mask": causal.to(device),
        }

    plain = estimate_activation_bytes(meta, **inputs("meta"))
    assert plain == estimate_activation_bytes(real, **inputs("cpu"))
    assert plain.recompute_bytes == 0
    meta.gradient_checkpointing_enable()
    checkpointed = estimate_activation_bytes(meta, **inputs("meta"))
    assert checkpointed.saved_bytes < plain.saved_bytes / 3
    # Backward recomputes one decoder layer at a time: about a layer's share of the rest.
    layers = plain.saved_bytes - checkpointed.saved_bytes
    assert layers / 3 * 0.5 < checkpointed.recompute_bytes < layers / 3 * 1.5
    assert checkpointed.total_bytes < plain.total_bytes
