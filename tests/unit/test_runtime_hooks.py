"""One owner of an engine's hooks (see [Note: one owner of an engine's hooks] in
runtime/hooks.py): every hook a wrapped model puts on the user's module and parameters is
removed by `release_module()`, a rebuilt runtime leaves none of the old one's behind, and a
model dropped while tensors it hooked live on leaves no hook on them once collected."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import shardwise
from shardwise.runtime.hooks import HookSet


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    )


def _hook_counts(module: nn.Module, params: list[torch.Tensor]) -> tuple[int, int]:
    """(forward hooks on the module tree, gradient hooks on `params`)."""
    forward = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())
    grad = sum(len(p._post_accumulate_grad_hooks or {}) for p in params)
    return forward, grad


def _grad_faces(wrapped: shardwise.ZeroModel) -> list[torch.Tensor]:
    """The tensors autograd accumulates gradients on: the parameters, or at stage 3 their
    compute faces (see [Note: two faces of a stage-3 parameter] in chunk/parameters.py)."""
    return [info.compute for chunk in wrapped.chunk_manager.chunks for info in chunk.tensors]


def _wrapped(stage: int) -> tuple[nn.Module, shardwise.ZeroModel, Any]:
    net = _net()
    config: dict[str, Any] = {"device": torch.device("cpu")}
    if stage == 3:
        config["chunk_size_numel"] = 256
    wrapped = shardwise.zero_model_wrapper(net, stage, config)
    optimizer = shardwise.zero_optim_wrapper(wrapped, torch.optim.AdamW(net.parameters()))
    return net, wrapped, optimizer


def _train(wrapped: shardwise.ZeroModel, optimizer: Any) -> None:
    optimizer.zero_grad()
    optimizer.backward(wrapped(torch.randn(4, 8)).square().mean())
    optimizer.step()


def test_a_hook_set_removes_its_parts_with_it_and_a_part_alone() -> None:
    module = nn.Linear(2, 2)
    hooks = HookSet()
    hooks.add(module.register_forward_hook(lambda *_: None))
    part = hooks.part()
    part.add(module.register_forward_pre_hook(lambda *_: None))
    assert (len(hooks), len(part)) == (2, 1)
    part.remove()
    assert (len(module._forward_hooks), len(module._forward_pre_hooks), len(hooks)) == (1, 0, 1)
    hooks.part().add(module.register_forward_pre_hook(lambda *_: None))
    hooks.remove()
    assert (len(module._forward_hooks), len(module._forward_pre_hooks), len(hooks)) == (0, 0, 0)
    hooks.remove()  # again: nothing to do


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_release_module_leaves_no_hook_of_the_engine(stage: int) -> None:
    net = _net()
    params = list(net.parameters())
    before = _hook_counts(net, params)
    assert before == (0, 0)
    _, wrapped, optimizer = _wrapped(stage)
    _train(wrapped, optimizer)
    net, params = wrapped.module, _grad_faces(wrapped)
    forward, grad = _hook_counts(net, params)
    assert forward >= 2 and grad == len(params)  # the root's two; one per trainable tensor
    runtime = wrapped._runtime
    assert runtime is not None and not runtime.closed
    wrapped.release_module()
    assert _hook_counts(net, params) == (0, 0)
    assert runtime.closed


@pytest.mark.parametrize("stage", [1, 2])
def test_a_rebuilt_runtime_leaves_none_of_the_old_ones_hooks(stage: int) -> None:
    """Stages 1-2 used before their optimizer is wrapped rebuild their runtime for the bucket
    size the wrapper learns (see [Note: packed once the bucket size is known])."""
    net = _net()
    wrapped = shardwise.zero_model_wrapper(net, stage, {"device": torch.device("cpu")})
    wrapped(torch.randn(4, 8)).sum().backward()  # packed, hooked: before the optimizer
    first = wrapped._runtime
    optimizer = shardwise.zero_optim_wrapper(
        wrapped, torch.optim.AdamW(net.parameters()), optim_config={"reduce_bucket_size": 64}
    )
    assert first is not None and first.closed and wrapped._runtime is not first
    _train(wrapped, optimizer)
    params = _grad_faces(wrapped)
    assert _hook_counts(net, params) == (2, len(params))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_dropped_model_leaves_no_hook_on_the_tensors_that_outlive_it(stage: int) -> None:
    net, wrapped, optimizer = _wrapped(stage)
    _train(wrapped, optimizer)
    kept = _grad_faces(wrapped)
    assert _hook_counts(net, kept)[1] == len(kept)
    runtime = weakref.ref(wrapped._runtime)
    del net, wrapped, optimizer
    gc.collect()
    assert runtime() is None
    assert sum(len(p._post_accumulate_grad_hooks or {}) for p in kept) == 0
