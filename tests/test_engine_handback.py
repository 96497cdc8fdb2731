"""What the engine hands back and takes in whole, on 2 ranks, fp32 at stage 3:
- `shardwise.checkpoint.gather_optimizer_state` and `load_optimizer_state`: the whole optimizer
  state in torch's format, in memory, equal to the bit to torch's AdamW's over the plain model
  trained on the same global batches; a fresh model and optimizer given it (and the model's
  state dict) continue exactly as the run that gave it;
- `ZeroModel.release_module`: the module back whole (plain parameters holding the values the
  engine's state dict gives, no hook left), so that a new engine wraps it again and trains on
  as the old one would have.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, adamw, batch_slice, make_model
from torch import nn

from shardwise import ZeroModel, zero_model_wrapper, zero_optim_wrapper
from shardwise.checkpoint import gather_optimizer_state, load_optimizer_state
from shardwise.engine.optimizer import ZeroOptimizer
from shardwise.testing import run_ranks

STEPS = 2


def _wrap(model: nn.Module) -> tuple[ZeroModel, ZeroOptimizer]:
    config = {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL}
    wrapped = zero_model_wrapper(model, 3, config)
    optimizer = zero_optim_wrapper(wrapped, adamw(model.parameters()))
    assert isinstance(wrapped, ZeroModel) and isinstance(optimizer, ZeroOptimizer)
    return wrapped, optimizer


def _step(model: ZeroModel, optimizer: ZeroOptimizer, step: int) -> float:
    optimizer.zero_grad()
    loss = model(*batch_slice(step, 0, dist.get_rank(), 2))
    optimizer.backward(loss)
    optimizer.step()
    return float(loss)


def _cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, optimizer = _wrap(make_model())
    for step in range(STEPS):
        _step(model, optimizer, step)
    whole_optimizer = gather_optimizer_state(optimizer, only_rank_0=False)
    whole_model = model.state_dict(only_rank_0=False)
    out["optimizer_state"] = whole_optimizer
    # A fresh engine given both in memory continues as this one does.
    fresh, fresh_optimizer = _wrap(make_model())
    fresh.load_state_dict(whole_model)
    load_optimizer_state(fresh_optimizer, whole_optimizer)
    out["continued"] = _step(model, optimizer, STEPS)
    out["resumed"] = _step(fresh, fresh_optimizer, STEPS)
    out["continued_state"] = model.state_dict(only_rank_0=False)
    out["resumed_state"] = fresh.state_dict(only_rank_0=False)
    # Handed back whole, wrapped again: the same values, and training goes on alike.
    before = model.state_dict(only_rank_0=False)
    module = model.release_module()
    out["released_state"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    out["released_plain"] = all(type(p) is nn.Parameter for p in module.parameters())
    out["released_whole"] = all(p.numel() > 0 for p in module.parameters())
    out["before_release"] = before
    rewrapped, _ = _wrap(module)
    out["rewrapped_state"] = rewrapped.state_dict(only_rank_0=False)
    out["refused_after_release"] = ""
    try:
        model.release_module()
    except ValueError as error:
        out["refused_after_release"] = str(error)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_cases, 2)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def test_whole_optimizer_state_in_memory_resumes_exactly(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["resumed"] == out["continued"]
        _equal(out["resumed_state"], out["continued_state"])


def _plain_adamw_state() -> dict[str, Any]:
    """torch's AdamW over the plain model, each step's gradient the average of the ranks'
    slices' (the data-parallel computation written out, as helpers.reference does)."""
    model = make_model()
    optimizer = adamw(model.parameters())
    for step in range(STEPS):
        totals = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(2):
            model.zero_grad()
            model(*batch_slice(step, 0, rank, 2)).backward()
            for total, param in zip(totals, model.parameters(), strict=True):
                if param.grad is not None:
                    total.add_(param.grad)
        for param, total in zip(model.parameters(), totals, strict=True):
            param.grad = total / 2 if param.grad is not None else None
        optimizer.step()
    return optimizer.state_dict()


def test_whole_optimizer_state_is_torchs_own(ranks: list[dict[str, Any]]) -> None:
    # The same numbering, hyper-parameters and per-parameter state, to the bit, as torch's
    # AdamW trained on the plain model; a parameter no gradient reached has none in both.
    plain = _plain_adamw_state()
    for out in ranks:
        gathered = out["optimizer_state"]
        assert [g["params"] for g in gathered["param_groups"]] == [
            g["params"] for g in plain["param_groups"]
        ]
        for ours, theirs in zip(gathered["param_groups"], plain["param_groups"], strict=True):
            for key in ("lr", "betas", "eps", "weight_decay", "amsgrad"):
                assert ours[key] == theirs[key], key
        assert gathered["state"].keys() == plain["state"].keys()
        for number, fields in plain["state"].items():
            for key, value in fields.items():
                assert torch.equal(gathered["state"][number][key], value), (number, key)
        assert "loss_scaler" in gathered


def test_released_module_is_whole_and_wraps_again(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["released_plain"] and out["released_whole"]
        _equal(out["released_state"], out["before_release"])
        _equal(out["rewrapped_state"], out["before_release"])
        assert "already released" in out["refused_after_release"]
