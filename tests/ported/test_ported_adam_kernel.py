"""Ported from hpcaitech/ColossalAI, tests/test_optimizer/test_adam_kernel.py (0.3.x).

The Adam kernels against an fp32 torch Adam written out by hand: 3 updates of a 64-element
parameter, with (parameter, gradient) dtypes fp32/fp16, fp32/fp32, fp16/fp16, fp32/bf16 and
bf16/bf16, weight decay 0 and 0.1, Adam and AdamW. Kept: the reference, the sweep, the
tolerances (rtol 1e-5, atol 1e-8; 1e-3 with fp16; 4e-3 with bf16) and both assertions. Our
kernel is `HybridAdam.step()` (the fused torch kernel with our mixed-precision handling), for
both the original's "fused" and "cpu" cases, on the CPU.

Deliberate difference: the original gives its kernel moments in the parameter's dtype (16-bit
moments for a 16-bit parameter); ours keeps fp32 moments for 16-bit parameters, as ColossalAI's
HybridAdam / CPUAdam optimizers do, so the moments are not handed in but live in its state.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwise import HybridAdam

P_G_TYPES = [
    (torch.float, torch.half),
    (torch.float, torch.float),
    (torch.half, torch.half),
    (torch.float, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
]


class TorchAdamKernel:
    def __init__(
        self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool
    ) -> None:
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.weight_decay, self.use_adamw = weight_decay, adamw

    def update(
        self,
        step: int,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
    ) -> None:
        bias_correction1 = 1 - self.beta1**step
        bias_correction2 = 1 - self.beta2**step
        if self.weight_decay != 0:
            if self.use_adamw:
                param.mul_(1 - self.lr * self.weight_decay)
            else:
                grad = grad.add(param, alpha=self.weight_decay)
        exp_avg.mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
        exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(self.eps)
        param.addcdiv_(exp_avg, denom, value=-self.lr / bias_correction1)


@pytest.mark.parametrize("adamw", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("p_dtype, g_dtype", P_G_TYPES)
def test_adam_kernel(
    adamw: bool, weight_decay: float, p_dtype: torch.dtype, g_dtype: torch.dtype
) -> None:
    rtol, atol = 1e-5, 1e-8
    if p_dtype is torch.float16 or g_dtype is torch.float16:
        rtol, atol = 1e-3, 1e-3
    if p_dtype is torch.bfloat16 or g_dtype is torch.bfloat16:
        rtol, atol = 4e-3, 4e-3
    lr, beta1, beta2, eps = 1e-3, 0.9, 0.999, 1e-8
    torch.manual_seed(0)
    torch_adam = TorchAdamKernel(lr, beta1, beta2, eps, weight_decay, adamw)
    master_p = torch.rand(64)
    master_g = torch.rand_like(master_p)
    master_exp_avg = torch.zeros_like(master_p)
    master_exp_avg_sq = torch.zeros_like(master_p)
    p = torch.nn.Parameter(master_p.clone().to(p_dtype))
    p.grad = torch.zeros_like(p)
    p.grad.data = master_g.clone().to(g_dtype)
    optimizer = HybridAdam(
        [p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, adamw_mode=adamw
    )
    for step in range(1, 4):
        torch_adam.update(step, master_p, master_g, master_exp_avg, master_exp_avg_sq)
        optimizer.step()
        assert not torch.isnan(p).any()
        assert torch.allclose(master_p, p.float(), rtol=rtol, atol=atol)
