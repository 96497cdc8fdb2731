"""HybridAdam against torch's Adam and AdamW."""

from __future__ import annotations

import pytest
import torch

from shardwise import HybridAdam


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
