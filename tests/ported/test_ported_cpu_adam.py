"""Ported from hpcaitech/ColossalAI, tests/test_optimizer/test_cpu_adam.py (0.1.x-0.2.x).

The original drives the CPUAdam C++ kernel directly for one update from random moments at step
1 or 2, with fp32 or fp16 parameters and gradients, and compares parameter, gradient and both
moments with a hand-written fp32 Adam update (threshold 1e-3 on the largest absolute
difference). Here the same update goes through `CPUAdam.step()`: the random moments and the step
count are put into the optimizer's state, which is where our kernel reads them. Kept: the
reference function, the dtype/step/mode sweep and all four assertions. Changed: 64 random draws
per case instead of 1024 (each draw is an independent repetition of the same check).

Deliberate difference: for an fp16 parameter ColossalAI's kernel keeps fp32 moments too; ours
does the same (see [Note: mixed precision in HybridAdam]), so the moment checks are unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwise import CPUAdam

DRAWS = 64


def torch_adam_update(
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    use_adamw: bool,
) -> None:
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    if weight_decay != 0:
        if use_adamw:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    step_size = lr / bias_correction1
    param.addcdiv_(exp_avg, denom, value=-step_size)


@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("p_dtype", [torch.float, torch.half])
@pytest.mark.parametrize("g_dtype", [torch.float, torch.half])
def test_cpu_adam(adamw: bool, step: int, p_dtype: torch.dtype, g_dtype: torch.dtype) -> None:
    lr = 1e-3
    beta1, beta2 = 0.9, 0.999
    eps = 1e-8
    weight_decay = 0.0
    torch.manual_seed(step)

    for _ in range(DRAWS):
        p_data = torch.rand(64, dtype=p_dtype)
        p_data_copy = p_data.clone().float()
        p_grad = torch.rand(64, dtype=g_dtype)
        p_grad_copy = p_grad.clone().float()
        exp_avg = torch.rand(p_data.shape)
        exp_avg_copy = exp_avg.clone()
        exp_avg_sq = torch.rand(p_data.shape)
        exp_avg_sq_copy = exp_avg_sq.clone()

        param = torch.nn.Parameter(p_data)
        param.grad = torch.zeros_like(param)
        param.grad.data = p_grad
        optimizer = CPUAdam(
            [param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
            adamw_mode=adamw,
        )  # fmt: skip
        # The state the original hands its kernel: moments, and the steps taken before.
        optimizer.state[param] = {
            "step": torch.tensor(float(step - 1)),
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
        }
        optimizer.step()
        state = optimizer.state[param]

        torch_adam_update(
            step, lr, beta1, beta2, eps, weight_decay, p_data_copy, p_grad_copy, exp_avg_copy,
            exp_avg_sq_copy, adamw,
        )  # fmt: skip
        threshold = 1e-3
        data_diff = torch.max(torch.abs(p_data_copy - param.data.float()))
        assert data_diff < threshold, f"p_data diff {data_diff}, step {step}, {p_dtype}, {g_dtype}"
        max_grad_diff = torch.max(torch.abs(p_grad_copy - param.grad.float()))
        assert max_grad_diff < threshold, f"diff {max_grad_diff}"
        max_exp_avg_diff = torch.max(torch.abs(exp_avg_copy - state["exp_avg"]))
        assert max_exp_avg_diff < threshold, f"max_exp_avg_diff {max_exp_avg_diff}"
        max_exp_avg_sq_diff = torch.max(torch.abs(exp_avg_sq_copy - state["exp_avg_sq"]))
        assert max_exp_avg_sq_diff < threshold, f"max_exp_avg_sq_diff {max_exp_avg_sq_diff}"
        assert float(state["step"]) == step
