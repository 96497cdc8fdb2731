"""HybridAdam against torch's Adam and AdamW."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardwise import CPUAdam, HybridAdam


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_equals_torch_fused_adam_step_for_step(adamw_mode: bool, amsgrad: bool) -> None:
    torch.manual_seed(0)
    initial = [torch.randn(1000), torch.randn(37), torch.randn(5, 3)]
    ours = [p.clone() for p in initial]
    theirs = [p.clone() for p in initial]
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": amsgrad, "betas": (0.8, 0.99)}
    optimizer = HybridAdam(ours, adamw_mode=adamw_mode, **kwargs)  # type: ignore[arg-type]
    reference = torch_class(theirs, fused=True, **kwargs)  # type: ignore[arg-type]
    for _ in range(5):
        for a, b in zip(ours, theirs, strict=True):
            grad = torch.randn_like(a)
            a.grad, b.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)


def test_grad_scale_unscales_inside_the_update() -> None:
    torch.manual_seed(0)
    scaled, plain = torch.randn(64), None
    plain = scaled.clone()
    a, b = HybridAdam([scaled], lr=0.1), HybridAdam([plain], lr=0.1)
    grad = torch.randn(64)
    scaled.grad, plain.grad = grad * 1024, grad.clone()
    a.step(grad_scale=1024.0)
    b.step()
    assert torch.allclose(scaled, plain, rtol=0, atol=1e-7)


def test_bad_hyper_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="betas"):
        HybridAdam([torch.zeros(1)], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="lr must be >= 0, got -1"):
        HybridAdam([torch.zeros(1)], lr=-1)


def _assign_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Give `param` a gradient of another dtype, as mixed-precision code does (torch refuses the
    plain assignment `param.grad = grad` when the dtypes differ)."""
    param.grad = torch.zeros_like(param)
    param.grad.data = grad


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize(
    "param_dtype, grad_dtype",
    [
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("optimizer_class", [HybridAdam, CPUAdam])
def test_16_bit_params_and_grads_step_exactly_as_fp32_adam(
    optimizer_class: type[HybridAdam],
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    adamw_mode: bool,
) -> None:
    # Reference: torch's Adam/AdamW on an fp32 copy given the gradient widened to fp32 (exact)
    # and, for a 16-bit parameter, the result rounded back to its dtype after every step: the
    # semantics of [Note: mixed precision in HybridAdam]. Bit-for-bit.
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(257).to(param_dtype))
    reference_param = torch.nn.Parameter(param.detach().float().clone())
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    kwargs: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.99)}
    optimizer = optimizer_class([param], adamw_mode=adamw_mode, **kwargs)
    reference = torch_class([reference_param], fused=True, **kwargs)
    for step in range(4):
        grad = torch.randn(257).to(grad_dtype)
        _assign_grad(param, grad)
        reference_param.grad = grad.float()
        optimizer.step(grad_scale=None if step < 2 else 1.0)
        reference.step()
        with torch.no_grad():
            reference_param.copy_(reference_param.to(param_dtype).float())
        assert param.dtype == param_dtype
        assert torch.equal(param.float(), reference_param)
    state = optimizer.state[param]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(state["exp_avg"], reference.state[reference_param]["exp_avg"])


def test_grad_scale_applies_to_16_bit_gradients() -> None:
    torch.manual_seed(0)
    scaled, plain = torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(64))
    plain.data.copy_(scaled.data)
    grad = torch.randn(64).half()
    _assign_grad(scaled, (grad.float() * 256).half())  # a power of two: exact in fp16
    _assign_grad(plain, grad)
    HybridAdam([scaled], lr=0.1).step(grad_scale=256.0)
    HybridAdam([plain], lr=0.1).step()
    assert torch.equal(scaled, plain)


def test_16_bit_state_survives_a_state_dict_round_trip() -> None:
    # torch's load_state_dict casts state to the parameter's dtype; the fp32 moments must come
    # back fp32, and training must go on exactly as without the round trip.
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(33).bfloat16())
    b = torch.nn.Parameter(a.detach().clone())
    opt_a, opt_b = HybridAdam([a], lr=1e-2), HybridAdam([b], lr=1e-2)
    grads = [torch.randn(33).bfloat16() for _ in range(3)]
    a.grad, b.grad = grads[0].clone(), grads[0].clone()
    opt_a.step()
    opt_b.step()
    saved = opt_b.state_dict()
    opt_b = HybridAdam([b], lr=1e-2)
    opt_b.load_state_dict(saved)
    for grad in grads[1:]:
        a.grad, b.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()
    assert opt_b.state[b]["exp_avg"].dtype == torch.float32
    # Loading rounds the saved fp32 moments through bf16 once, so b may differ in the last
    # bits of its moments; the parameters must still agree to bf16 resolution.
    assert torch.allclose(a.float(), b.float(), rtol=0, atol=2e-2)


def test_unusable_pairs_and_flags_are_refused() -> None:
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    _assign_grad(param, torch.zeros(4, dtype=torch.float16))
    with pytest.raises(TypeError, match="fp64 parameters need fp64 gradients"):
        HybridAdam([param]).step()
    param = torch.nn.Parameter(torch.zeros(4))
    _assign_grad(param, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"got a torch.float32 parameter with a torch.int32"):
        HybridAdam([param]).step()
    with pytest.raises(ValueError, match="bias_correction=False cannot be honoured"):
        HybridAdam([param], bias_correction=False)
    HybridAdam([param], bias_correction=True)  # ColossalAI's default is accepted
