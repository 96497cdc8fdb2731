"""GPU checks: skipped on machines without CUDA (CI has none); run them where a GPU is lent."""

from __future__ import annotations

import pytest
import torch

from shardwise import HybridAdam, MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import GPT, GPTConfig, gpt_batch, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)


def _train(device: str, placement: str, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    precision = MixedPrecision(param_dtype=torch.bfloat16) if device == "cuda" else MixedPrecision()
    wrapped = zero_model_wrapper(
        model,
        3,
        {
            "device": torch.device(device),
            "placement_policy": placement,
            "chunk_size_numel": 32 * 1024,
            "mixed_precision": precision,
        },
    )
    optimizer = zero_optim_wrapper(wrapped, HybridAdam(model.parameters(), lr=1e-3))
    losses = []
    for step in range(steps):
        idx, targets = gpt_batch(CONFIG, 8, 32, step)
        optimizer.zero_grad()
        _, loss = wrapped(idx.to(device), targets.to(device))
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("placement", ["cuda", "cpu", "auto"])
def test_stage3_on_cuda_tracks_the_cpu_run(placement: str) -> None:
    reference = run_ranks(_train, 1, "cpu", "cuda", 5)[0]
    losses = run_ranks(_train, 1, "cuda", placement, 5, backend="nccl")[0]
    # bf16 compute on the GPU against fp32 on the CPU: two to three decimal digits.
    assert losses == pytest.approx(reference, rel=3e-2)
