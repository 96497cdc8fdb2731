"""What the ports of ColossalAI 0.5's tests/test_zero/test_gemini/ share: its model zoo's
`transformers_gpt_lm` at a tiny size, its `DummyDataloader` batches, a DDP reference stepped
as a user steps one, and the chunk configuration those tests give `GeminiDDP` (the searched
configuration with `chunk_size` 5000).

The DDP side is fp32 with `find_unused_parameters=True` and torch's Adam (the originals step
ZeRO with HybridAdam and DDP with apex O2's Adam; torch's Adam on both sides leaves the engine
alone under test: see tests/ported/test_ported_gemini_optim.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel

from shardwise.utils import set_seed
from shardwise.zero.gemini.chunk import search_chunk_configuration

VOCAB, SEQ, BATCH = 128, 16, 2
LR = 1e-3
# (rtol, atol) where clipping is involved: the engine sums the gradient norm over chunk shards,
# the reference per tensor, so the clipping factor differs in its last bits (see
# tests/ported/test_ported_gemini_optim.py).
CLIPPED = (1e-5, 1e-6)


def gpt_lm() -> GPT2LMHeadModel:
    """ColossalAI's `transformers_gpt_lm`, tiny, dropout off (its outputs carry the loss)."""
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def batches(seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """The original's `DummyDataloader(data_gen_fn)` after `set_seed(seed)`: endless batches
    of random tokens, labels the inputs."""
    set_seed(seed)
    while True:
        input_ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        yield {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": input_ids,
        }


def loss_of(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """The zoo's loss function for `transformers_gpt_lm`: the model's own."""
    loss: torch.Tensor = model(**data).loss
    return loss


def reference(model: nn.Module) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    """DDP over a copy of `model` (made before the engine wraps it) and torch's Adam."""
    torch_model = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    return torch_model, torch.optim.Adam(torch_model.parameters(), lr=LR)


def chunk_config(model: nn.Module, keep_gathered: bool = False) -> dict[int, dict[str, Any]]:
    """The originals' `search_chunk_configuration(model, search_range_m=1, search_interval=100)`
    with chunk_size 5000 and `keep_gathered` set."""
    config, *_ = search_chunk_configuration(model, search_range_m=1, search_interval=100)
    entry = config[dist.get_world_size()]
    entry["chunk_size"] = 5000
    entry["keep_gathered"] = keep_gathered
    return config


def mismatches(
    zero_model: nn.Module,
    torch_model: DistributedDataParallel,
    tolerance: tuple[float, float] | None = None,
    skip: Callable[[str], bool] = lambda key: False,
) -> list[str]:
    """Keys of the DDP model's state dict whose value the ZeRO model's whole state dict does
    not hold: bit for bit, or within `tolerance` (rtol, atol) when given."""
    zero = zero_model.state_dict(only_rank_0=False)  # type: ignore[call-arg]
    bad = []
    for key, value in torch_model.module.state_dict().items():
        if skip(key):
            continue
        mine = zero[key].to(value.dtype)
        same = (
            torch.equal(mine, value)
            if tolerance is None
            else torch.allclose(mine, value, rtol=tolerance[0], atol=tolerance[1])
        )
        if not same:
            bad.append(f"{key}: {float((mine.float() - value.float()).abs().max()):.3g}")
    return bad
