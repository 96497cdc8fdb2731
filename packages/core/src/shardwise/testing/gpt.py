"""A small GPT-style decoder and deterministic token batches, for tests, examples and
benchmarks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the toy GPT.

    Args:
        vocab_size: tokens in the vocabulary.
        block_size: longest sequence (positions embedded).
        n_layer: transformer blocks.
        n_head: attention heads; must divide `n_embd`.
        n_embd: model width.
        tie_weights: share the token embedding with the output head.
    """

    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(width, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, seq, width))
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.fc_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))
        return out


class GPT(nn.Module):
    """Token and position embeddings, `n_layer` pre-norm blocks, final norm, vocabulary head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks: list[Block] = nn.ModuleList(  # type: ignore[assignment]
            Block(config) for _ in range(config.n_layer)
        )
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # Residual projections scaled down with depth, so activations keep their size.
        for block in self.blocks:
            for proj in (block.attn.proj, block.fc_proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab) for token ids `idx` (B, T), and the mean cross-entropy against
        `targets` (B, T) when given."""
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        positions = torch.arange(seq, device=idx.device)
        x = self.wte(idx) + self.wpe(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        """Parameters counted once each (a tied weight once)."""
        return sum(p.numel() for p in self.parameters())


def gpt_batch(
    config: GPTConfig, batch_size: int, seq_len: int, step: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch (idx, targets), each (batch_size, seq_len), for `step`: the same in
    every process, so each rank can take its slice of one global batch. The targets follow a
    fixed rule of the inputs (next token = a function of the current one) so loss can fall."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    idx = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator)
    targets = (idx * 7 + 3) % config.vocab_size
    return idx, targets
