"""Ported from hpcaitech/ColossalAI (0.5): tests/test_zero/test_gemini/test_inference.py
(`exam_inference`).

GPT-2 in eval mode in GeminiDDP under each of the original's placements (static with every
chunk gathered, every chunk sharded and half of them sharded, and "auto"), built both ways
the original builds it (`single_chunk_init`: the chunk size searched; `multi_chunk_init`: the
searched configuration with chunk_size 5000), stepped by GeminiOptimizer beside DDP: a
training step, an inference step under `torch.no_grad()`, another training step. Kept: the
losses of each step agree, and after each training step every parameter equals DDP's.

Deliberate differences: fp32 (`mixed_precision=torch.float32`) instead of fp16 against apex
O2, so losses and parameters are compared bit for bit (the original: 1e-5 and (1e-3, 4e-3));
torch's Adam on both sides (see gemini_ports.py); 2 ranks (the original runs 1 and 4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from gemini_ports import LR, batches, chunk_config, gpt_lm, loss_of, mismatches, reference
from torch import nn

from shardwise.testing import run_ranks
from shardwise.utils import set_seed
from shardwise.zero import GeminiDDP, GeminiOptimizer

PLACEMENTS: list[dict[str, Any]] = [
    {"placement_policy": "static", "shard_param_frac": 0.0},  # zero2
    {"placement_policy": "static", "shard_param_frac": 1.0},  # zero3
    {"placement_policy": "static", "shard_param_frac": 0.5},  # zero3-half
    {"placement_policy": "auto"},
]


def _multi_chunk_init(model: nn.Module, placement: dict[str, Any]) -> GeminiDDP:
    return GeminiDDP(
        model, chunk_config(model), pin_memory=True, mixed_precision=torch.float32, **placement
    )


def _single_chunk_init(model: nn.Module, placement: dict[str, Any]) -> GeminiDDP:
    return GeminiDDP(model, pin_memory=True, mixed_precision=torch.float32, **placement)


INITS: dict[str, Callable[[nn.Module, dict[str, Any]], GeminiDDP]] = {
    "single_chunk_init": _single_chunk_init,
    "multi_chunk_init": _multi_chunk_init,
}


def _exam_inference() -> dict[str, list[str]]:
    results: dict[str, list[str]] = {}
    for placement in PLACEMENTS:
        for init_name, init in INITS.items():
            set_seed(19360226)
            model = gpt_lm().eval()
            torch_model, torch_optim = reference(model)
            model = init(model, placement)
            zero_optim = GeminiOptimizer(
                torch.optim.Adam(model.parameters(), lr=LR), model, initial_scale=128
            )
            data = batches(dist.get_rank() * 3 + 128)
            bad: list[str] = []
            for phase in ("train", "inference", "train"):
                batch = next(data)
                if phase == "inference":
                    with torch.no_grad():
                        torch_loss, zero_loss = loss_of(torch_model, batch), loss_of(model, batch)
                    if not torch.equal(torch_loss, zero_loss):
                        bad.append(f"inference loss {float(torch_loss)} != {float(zero_loss)}")
                    continue
                zero_optim.zero_grad()
                torch_optim.zero_grad()
                torch_loss = loss_of(torch_model, batch)
                torch_loss.backward()
                zero_loss = loss_of(model, batch)
                zero_optim.backward(zero_loss)
                if not torch.equal(torch_loss, zero_loss):
                    bad.append(f"train loss {float(torch_loss)} != {float(zero_loss)}")
                zero_optim.step()
                torch_optim.step()
                bad += mismatches(model, torch_model)
            results[f"{placement} {init_name}"] = bad
    return results


def test_inference_between_training_steps_matches_ddp() -> None:
    for results in run_ranks(_exam_inference, 2):
        assert len(results) == len(PLACEMENTS) * len(INITS)
        assert all(not bad for bad in results.values()), results
