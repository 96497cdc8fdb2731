"""`GeneralCheckpointIO` on a plain torch model in one process, ported from ColossalAI
(hpcaitech/ColossalAI, tests/test_checkpoint_io/test_general_checkpoint_io.py):
`test_unsharded_checkpoint`, `test_sharded_model_checkpoint`,
`test_sharded_optimizer_checkpoint` and `test_sharded_optimizer_multiple_param_groups`.

Translation: a small convolutional network stands in for torchvision's resnet18 (same kinds of
layers: convolutions, batch norms with their running statistics, a linear head), fed 32x32
images; torch's CosineAnnealingLR for ColossalAI's CosineAnnealingWarmupLR; `size_per_shard`
small enough for several files. `use_async` is accepted and writes before returning, so the
original's `_sync_d2h` / `_sync_io` have nothing left to wait for. The originals compare with
`check_state_dict_equal`; here every tensor must be equal, exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import Adam

from shardwise.checkpoint_io import GeneralCheckpointIO


def _net() -> nn.Module:
    def block(inputs: int, outputs: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(inputs, outputs, 3, padding=1, bias=False),
            nn.BatchNorm2d(outputs),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )

    model = nn.Sequential(block(3, 16), block(16, 32), block(32, 64), nn.Flatten())
    model.append(nn.Linear(64 * 4 * 4, 10))
    return model


def _trained(optimizer_of: Any = None, steps: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _net()
    optimizer = (optimizer_of or (lambda m: Adam(m.parameters(), lr=0.001)))(model)
    _train(model, optimizer, steps)
    return model, optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(step))
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _fresh(optimizer_of: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = _net()
    return model, (optimizer_of or (lambda m: Adam(m.parameters(), lr=0.001)))(model)


def _assert_equal(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str)
        for key in a:
            _assert_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for left, right in zip(a, b, strict=True):
            _assert_equal(left, right)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("use_safetensors", [True, False])
@pytest.mark.parametrize("use_async", [False, True])
def test_unsharded_checkpoint(use_safetensors: bool, use_async: bool, tmp_path: Path) -> None:
    model, optimizer = _trained(steps=0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    _train(model, optimizer, 1)
    scheduler.step()
    suffix = ".safetensors" if use_safetensors else ".bin"
    io = GeneralCheckpointIO()
    io.save_model(model, str(tmp_path / f"model{suffix}"), use_safetensors=use_safetensors,
                  use_async=use_async)  # fmt: skip
    io.save_optimizer(optimizer, str(tmp_path / "optim"), use_async=use_async)
    io.save_lr_scheduler(scheduler, str(tmp_path / "scheduler"))
    new_model, new_optimizer = _fresh()
    new_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(new_optimizer, T_max=10)
    io.load_model(new_model, str(tmp_path / f"model{suffix}"))
    io.load_optimizer(new_optimizer, str(tmp_path / "optim"))
    io.load_lr_scheduler(new_scheduler, str(tmp_path / "scheduler"))
    _assert_equal(model.state_dict(), new_model.state_dict())
    _assert_equal(optimizer.state_dict(), new_optimizer.state_dict())
    assert new_scheduler.get_last_lr() == scheduler.get_last_lr()


@pytest.mark.parametrize("use_safetensors", [True, False])
def test_sharded_model_checkpoint(use_safetensors: bool, tmp_path: Path) -> None:
    model, optimizer = _trained()
    io = GeneralCheckpointIO()
    io.save_model(model, str(tmp_path / "model"), True, True, "", 0.02,
                  use_safetensors=use_safetensors)  # fmt: skip
    assert len(list((tmp_path / "model").glob("*.safetensors" if use_safetensors else "*.bin"))) > 2
    io.save_optimizer(optimizer, str(tmp_path / "optim.bin"), shard=False)
    new_model, new_optimizer = _fresh()
    io.load_model(new_model, str(tmp_path / "model"), strict=True)
    io.load_optimizer(new_optimizer, str(tmp_path / "optim.bin"))
    _assert_equal(model.state_dict(), new_model.state_dict())
    _assert_equal(optimizer.state_dict(), new_optimizer.state_dict())


def test_sharded_optimizer_checkpoint(tmp_path: Path) -> None:
    model, optimizer = _trained()
    io = GeneralCheckpointIO()
    io.save_model(model, str(tmp_path / "model"), True, True, "", 0.02)
    io.save_optimizer(optimizer, str(tmp_path / "optim"), shard=True, size_per_shard=0.02)
    assert len(list((tmp_path / "optim").glob("pytorch_optim-*.bin"))) > 2
    new_model, new_optimizer = _fresh()
    io.load_model(new_model, str(tmp_path / "model"), strict=True)
    io.load_optimizer(new_optimizer, str(tmp_path / "optim"))
    _assert_equal(model.state_dict(), new_model.state_dict())
    _assert_equal(optimizer.state_dict(), new_optimizer.state_dict())
    # Training goes on from the loaded state exactly as from the saved one.
    _train(model, optimizer, 3)
    _train(new_model, new_optimizer, 3)
    _assert_equal(model.state_dict(), new_model.state_dict())
    # Saved again over the same directories, and read back.
    io.save_model(new_model, str(tmp_path / "model"), True, True, "", 0.02)
    io.save_optimizer(new_optimizer, str(tmp_path / "optim"), shard=True, size_per_shard=0.02)
    newer_model, newer_optimizer = _fresh()
    io.load_model(newer_model, str(tmp_path / "model"), strict=True)
    io.load_optimizer(newer_optimizer, str(tmp_path / "optim"))
    _assert_equal(new_model.state_dict(), newer_model.state_dict())
    _assert_equal(new_optimizer.state_dict(), newer_optimizer.state_dict())


def _two_groups(model: nn.Module) -> torch.optim.Optimizer:
    return Adam(
        [
            {"params": model[0].parameters()},
            {"params": model[1].parameters(), "lr": 0.002},
        ],
        lr=0.001,
    )


def test_sharded_optimizer_multiple_param_groups(tmp_path: Path) -> None:
    model, optimizer = _trained(_two_groups)
    io = GeneralCheckpointIO()
    io.save_model(model, str(tmp_path / "model"), True, True, "", 0.02)
    io.save_optimizer(optimizer, str(tmp_path / "optim"), shard=True, size_per_shard=0.02)
    new_model, new_optimizer = _fresh(_two_groups)
    io.load_model(new_model, str(tmp_path / "model"), strict=True)
    io.load_optimizer(new_optimizer, str(tmp_path / "optim"))
    _assert_equal(model.state_dict(), new_model.state_dict())
    _assert_equal(optimizer.state_dict(), new_optimizer.state_dict())
    assert [g["lr"] for g in new_optimizer.param_groups] == [0.001, 0.002]
