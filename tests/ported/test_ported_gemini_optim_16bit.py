"""Ported from hpcaitech/ColossalAI (0.5): tests/test_zero/test_gemini/test_optim.py
(`exam_model_step`; its `exam_tiny_example` is the 0.2.x test ported in
test_ported_gemini_components.py).

GPT-2 in eval mode in GeminiDDP built with ColossalAI 0.5's constructor (the searched chunk
configuration with chunk_size 5000) in fp16 and in bf16, under the original's placements
(static with 0.3 of the chunks sharded, 0.3 of their payloads and 0.3 of the optimizer state
offloaded, and "auto"), stepped by HybridAdam in a `GeminiOptimizer(initial_scale=128)`,
beside the same model in fp32 DDP with torch's Adam; 3 steps, each rank its own batches.
Kept: each step's losses agree within the original's (4e-2, 4e-2), and after each step every
parameter within its (2e-3, 6e-3) in fp16 and (4e-3, 8e-3) in bf16 (the 16-bit copy of
each parameter is rounded to its dtype, ~5e-4 relative in fp16 and ~4e-3 in bf16, and the
gradients are reduced in it). Also kept: ColossalAI ignores `offload_param_frac` with a warning
when `shard_param_frac` < 1, and so does the engine (asserted).

Deliberate differences: the reference is fp32 DDP where the original's is apex O2 (fp16 model,
fp32 masters), which this CPU has no kernels for; on the CPU the 16-bit copies compute in fp32
(see `storage_precision`); `master_weights=False` is refused (the engine always keeps fp32
masters); 2 ranks (the original runs 4).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gemini_ports import batches, chunk_config, gpt_lm, loss_of, mismatches, reference

from shardwise.nn.optimizer import HybridAdam
from shardwise.testing import run_ranks
from shardwise.utils import set_seed
from shardwise.zero import GeminiDDP, GeminiOptimizer

PLACEMENTS: list[dict[str, Any]] = [
    {
        "placement_policy": "static",
        "shard_param_frac": 0.3,
        "offload_param_frac": 0.3,
        "offload_optim_frac": 0.3,
    },
    {"placement_policy": "auto"},
]
PARAM_TOLERANCE = {torch.float16: (2e-3, 6e-3), torch.bfloat16: (4e-3, 8e-3)}


def _exam_model_step() -> dict[str, list[str]]:
    results: dict[str, list[str]] = {}
    for placement in PLACEMENTS:
        for dtype in (torch.float16, torch.bfloat16):
            set_seed(42)
            model = gpt_lm().eval()
            torch_model, torch_optim = reference(model)
            ignores_offload = placement.get("offload_param_frac", 0) > 0
            with (
                pytest.warns(UserWarning, match="offload_param_frac=0.3 is ignored")
                if (ignores_offload)
                else nullcontext()
            ):
                model = GeminiDDP(
                    model,
                    chunk_config(model),
                    mixed_precision=dtype,
                    enable_async_reduce=True,
                    **placement,
                )
            zero_optim = GeminiOptimizer(
                HybridAdam(model.parameters(), lr=1e-3), model, initial_scale=128
            )
            data = batches(dist.get_rank() * 3 + 128)
            bad: list[str] = []
            for step in range(3):
                batch = next(data)
                zero_optim.zero_grad()
                torch_optim.zero_grad()
                torch_loss = loss_of(torch_model, batch)
                torch_loss.backward()
                zero_loss = loss_of(model, batch)
                zero_optim.backward(zero_loss)
                if not torch.allclose(zero_loss.float(), torch_loss, rtol=4e-2, atol=4e-2):
                    bad.append(f"step {step} loss {float(zero_loss)} != {float(torch_loss)}")
                zero_optim.step()
                torch_optim.step()
                tolerance = PARAM_TOLERANCE[dtype]
                bad += [f"step {step} {m}" for m in mismatches(model, torch_model, tolerance)]
            results[f"{placement} {dtype}"] = bad
    return results


def test_16_bit_gemini_tracks_fp32_ddp() -> None:
    for results in run_ranks(_exam_model_step, 2):
        assert len(results) == 4
        assert all(not bad for bad in results.values()), results
