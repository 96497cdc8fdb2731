"""A tiny Switch Transformers model (8 top-1 experts behind a router in one encoder and one
decoder layer) for the stage-3 mixture-of-experts tests, with the randomness that would set a
sharded run apart from a plain one (router jitter, dropout) off."""

from __future__ import annotations

from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration


def tiny_switch(vocab_size: int) -> SwitchTransformersForConditionalGeneration:
    """The model, built from the current torch random state, in training mode."""
    config = SwitchTransformersConfig(
        vocab_size=vocab_size,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_heads=2,
        num_layers=2,
        num_decoder_layers=2,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
        num_experts=8,
        expert_capacity=64,
        router_jitter_noise=0.0,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return SwitchTransformersForConditionalGeneration(config).train()
