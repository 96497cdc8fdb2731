"""`colossalai.nn.optimizer.HybridAdam` / `CPUAdam` as `shardwise.nn.optimizer`: ColossalAI's
argument order and names, torch's fused AdamW update, and a clear refusal of what is not
offered."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.nn.optimizer import CPUAdam, HybridAdam
from shardwise.optim import HybridAdam as EngineHybridAdam


def test_positional_arguments_follow_colossalai_order() -> None:
    params = [nn.Parameter(torch.ones(3))]
    # ColossalAI: (model_params, lr, bias_correction, betas, eps, weight_decay, adamw_mode)
    optimizer = HybridAdam(params, 1e-2, True, (0.8, 0.9), 1e-6, 0.1, False)
    group = optimizer.param_groups[0]
    assert group["lr"] == 1e-2 and group["betas"] == (0.8, 0.9) and group["eps"] == 1e-6
    assert group["weight_decay"] == 0.1 and group["adamw_mode"] is False
    # The third positional argument is bias_correction, which the fused kernels always apply.
    with pytest.raises(ValueError, match="bias_correction=False cannot be honoured"):
        HybridAdam(params, 1e-2, False)
    assert isinstance(CPUAdam(params), EngineHybridAdam)


def test_steps_as_torch_fused_adamw() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    twin = nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    ours = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    for step in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for net, optimizer in ((model, ours), (twin, reference)):
            optimizer.zero_grad()
            net(x).square().sum().backward()
            optimizer.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_nvme_offload_outside_the_engine_and_unknown_arguments_are_refused() -> None:
    params = [nn.Parameter(torch.ones(3))]
    # The disk tier is the engine's (tests/test_disk_tier.py): stepped by a plain loop, the
    # NVMe arguments cannot be honoured.
    optimizer = HybridAdam(params, nvme_offload_fraction=0.5)
    params[0].grad = torch.ones(3)
    with pytest.raises(ValueError, match="honoured only when the engine steps"):
        optimizer.step()
    with pytest.raises(ValueError, match=r"nvme_offload_fraction must be a number in \[0, 1\]"):
        CPUAdam(params, nvme_offload_fraction=2.0)
    with pytest.raises(TypeError, match=r"unexpected arguments \['amsgrad'\]"):
        HybridAdam(params, amsgrad=True)
