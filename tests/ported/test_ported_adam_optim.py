"""Ported from hpcaitech/ColossalAI, tests/test_optimizer/test_adam_optim.py (0.2.x-0.3.x),
with `setup_param_groups` and `force_assign_grad` from tests/test_optimizer/_utils.py.

CPUAdam and HybridAdam against torch's Adam / AdamW on a transformer, with weight-decay groups,
for 3 steps of random gradients, with (parameter, gradient) dtypes fp32/fp32, fp32/fp16 and
fp32/bf16. Kept: the sweep, the groups, the per-dtype tolerances (1e-5; 2e-3 with fp16; 4e-3
with bf16) and both assertions (no NaN, allclose). Changed: the model is our toy GPT instead of
the model zoo's BERT (no transformers model zoo here), and the device is the CPU (the original
adds 'cuda:0' and FusedAdam, which we do not have).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardwise import CPUAdam, HybridAdam
from shardwise.testing import GPT, GPTConfig

N_STEPS = 3
ALLOWED_P_G_TYPES = [
    (torch.float, torch.float),  # pure fp32
    (torch.float, torch.half),  # fp16 amp
    (torch.float, torch.bfloat16),  # bf16 amp
]


def setup_param_groups(model: nn.Module) -> list[dict[str, object]]:
    no_decay = ["bias", "ln_", "LayerNorm.weight"]
    return [
        {
            "params": [
                p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)
            ],
            "weight_decay": 0.1,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]


def force_assign_grad(p: torch.Tensor, g_dtype: torch.dtype, grad: torch.Tensor) -> None:
    """Give `p` a gradient of dtype `g_dtype` (torch refuses `p.grad = g` across dtypes)."""
    p.grad = torch.zeros_like(p)
    p.grad.data = grad.clone().to(g_dtype)


@pytest.mark.parametrize("optim_cls", [CPUAdam, HybridAdam])
@pytest.mark.parametrize("adamw", [False, True])
@pytest.mark.parametrize("p_dtype, g_dtype", ALLOWED_P_G_TYPES)
def test_adam_optim_on_gpt(
    optim_cls: type[HybridAdam], adamw: bool, p_dtype: torch.dtype, g_dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    torch_model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32))
    model = copy.deepcopy(torch_model).to(p_dtype)
    lr = 1e-3
    beta1, beta2 = 0.9, 0.999
    eps = 1e-8
    torch_optim_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    torch_optim = torch_optim_cls(
        setup_param_groups(torch_model),  # type: ignore[arg-type]
        lr=lr, betas=(beta1, beta2), eps=eps,
    )  # fmt: skip
    optim = optim_cls(
        setup_param_groups(model),  # type: ignore[arg-type]
        lr=lr, betas=(beta1, beta2), eps=eps, adamw_mode=adamw,
    )  # fmt: skip

    rtol, atol = 1e-5, 1e-5
    if p_dtype is torch.float16 or g_dtype is torch.float16:
        rtol, atol = 2e-3, 2e-3
    if p_dtype is torch.bfloat16 or g_dtype is torch.bfloat16:
        rtol, atol = 4e-3, 4e-3

    for _ in range(N_STEPS):
        for p, torch_p in zip(model.parameters(), torch_model.parameters(), strict=True):
            torch_p.grad = torch.rand_like(torch_p)
            force_assign_grad(p, g_dtype, torch_p.grad)
        torch_optim.step()
        optim.step()
        torch_optim.zero_grad()
        optim.zero_grad()
        for p, torch_p in zip(model.parameters(), torch_model.parameters(), strict=True):
            assert not torch.isnan(p).any()
            assert torch.allclose(p.float(), torch_p, rtol=rtol, atol=atol)
