"""Parameters keep their shape after wrapping, so optimizer groups built by shape still work.

The grouping is nanoGPT's `configure_optimizers` (karpathy/nanoGPT, model.py): every parameter
with `dim() >= 2` decays, the others do not. It runs after wrapping, as Lightning always runs
`configure_optimizers` after the strategy sharded the model; the reference is DDP with the same
grouping built on its own copy.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo  # imported once here, not in every rank that builds DDP
import torch.distributed as dist
from helpers import CONFIG, batch_slice
from torch.nn.parallel import DistributedDataParallel

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import GPT, run_ranks


def _nanogpt_groups(model: torch.nn.Module) -> tuple[list[dict[str, Any]], int, int]:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return groups, len(decay), len(no_decay)


def _grouped_training(stage: int) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = GPT(CONFIG)
    ddp = DistributedDataParallel(plain)
    plain_groups, plain_decay, plain_no_decay = _nanogpt_groups(plain)
    plain_optimizer = torch.optim.AdamW(plain_groups, lr=1e-2)

    torch.manual_seed(0)
    model = GPT(CONFIG)
    options: dict[str, Any] = {"device": torch.device("cpu")}
    if stage == 3:
        options["chunk_size_numel"] = 1500
    wrapped = zero_model_wrapper(model, stage, options)
    shapes_after_wrapping = [tuple(p.shape) for p in model.parameters()]
    groups, decay, no_decay = _nanogpt_groups(model)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(groups, lr=1e-2))
    for step in range(3):
        idx, targets = batch_slice(step, 0, rank, 2)
        optimizer.zero_grad()
        optimizer.backward(wrapped(idx, targets)[1])
        optimizer.step()
        plain_optimizer.zero_grad()
        ddp(idx, targets)[1].backward()
        plain_optimizer.step()
    final, reference = wrapped.state_dict(only_rank_0=False), plain.state_dict()
    return {
        "groups": (decay, no_decay),
        "plain_groups": (plain_decay, plain_no_decay),
        "shapes": shapes_after_wrapping,
        "plain_shapes": [tuple(p.shape) for p in plain.parameters()],
        "same": all(torch.equal(final[k], reference[k]) for k in reference),
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shape_based_groups_after_wrapping_train_as_ddp(stage: int) -> None:
    for result in run_ranks(_grouped_training, 2, stage):
        assert result["shapes"] == result["plain_shapes"]
        assert result["groups"] == result["plain_groups"]
        assert result["groups"][0] > 0  # some tensors decay (none did when shapes read (0,))
        assert result["same"]


def _released_use() -> list[str]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    zero_model_wrapper(model, 3, {"device": torch.device("cpu"), "chunk_size_numel": 1500})
    weight = model.lm_head.weight
    messages = []
    for use in (lambda: weight.sum(), lambda: weight * 2, lambda: weight @ weight.T):
        try:
            use()
            messages.append("no error")
        except RuntimeError as error:
            messages.append(str(error))
    return messages


def test_a_released_parameter_used_in_compute_raises_naming_it() -> None:
    for messages in run_ranks(_released_use, 2):
        assert all("is released" in m or "whose chunk is released" in m for m in messages), messages


def test_a_copied_model_keeps_the_shapes() -> None:
    import copy

    torch.manual_seed(0)
    model = GPT(CONFIG)
    shapes = [tuple(p.shape) for p in model.parameters()]
    zero_model_wrapper(model, 3, {"device": torch.device("cpu"), "chunk_size_numel": 1500})
    copied = copy.deepcopy(model)
    assert [tuple(p.shape) for p in copied.parameters()] == shapes
