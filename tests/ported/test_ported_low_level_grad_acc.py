"""Ported from hpcaitech/ColossalAI, tests/test_zero/test_low_level/test_grad_acc.py
(`exam_zero_1_grad_acc`).

An MLP (128 -> 256 -> 512), ZeRO stage 1 (clipping at 1.0, Adam at lr 1) against torch DDP
(`bucket_cap_mb=0`, `clip_grad_norm_(1.0)`, Adam at lr 1) on 2 ranks, each its own two
micro-batches accumulated into one step: the first under `no_sync()` (the original's
`sync=True`) or not (`sync=False`), the second outside it. Kept: the outputs agree, the
gradients inside `no_sync()` are each rank's own (`p.grad` equal to DDP's), and the parameters
after the step agree (`assert_close`: the clip coefficient comes from a norm summed over shards,
another order than torch's per-tensor norms, so it differs in the last bits).

Translated: `zero_optimizer.no_sync()` is the model's `no_sync()`;
`LowLevelZeroOptimizer(..., overlap_communication=False, reduce_bucket_size=262144,
clip_grad_norm=1.0)` is `zero_optim_wrapper(..., max_norm=1.0, optim_config=...)`.

Added (what the port is for, see [Note: stage 1 averages in backward] in chunk/grads.py): after
every backward outside `no_sync()`, `p.grad` equals DDP's `.grad` bit for bit, the average over
the ranks (fp32, 2 ranks: (a + b) / 2 in both), after the first micro-batch and after the
second, which accumulates onto the first as under DDP, whether the first was synchronised or
not. The original checks `p.grad` inside `no_sync()` only; ColossalAI's stage 1 moves the
gradient out of `p.grad` after a synchronised backward.

Deliberate differences: fp32 on CPU (gloo) as the original, which already runs in fp32;
`exam_zero_1_2_grad_acc` (stages 1 and 2 accumulating two synchronised backward passes, equal
bit for bit) is not ported: our stage 1 accumulates as DDP does (the second pass's local gradient
is added onto the first pass's average, then averaged again), stage 2 adds the two averages,
which round differently; each matches its own reference (tests/test_parity.py,
tests/test_unused_parameters.py).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch._dynamo  # imported once here, not in every rank that builds DDP
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.testing import assert_close

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import run_ranks


class MlpModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(128, 256)
        self.linear2 = nn.Linear(256, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear1(x)
        x = self.linear2(x)
        return x


def _zero_1_grad_acc(sync: bool) -> dict[str, bool]:
    local_rank = dist.get_rank()
    torch.manual_seed(2008)
    zero_model = MlpModel()
    torch_model = copy.deepcopy(zero_model)
    initial = {name: p.detach().clone() for name, p in torch_model.named_parameters()}
    torch_ddp = DistributedDataParallel(torch_model, bucket_cap_mb=0)
    wrapped = zero_model_wrapper(zero_model, 1, {"device": torch.device("cpu")})
    zero_optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.Adam(zero_model.parameters(), lr=1),
        max_norm=1.0,
        optim_config={"reduce_bucket_size": 262144, "overlap_communication": False},
    )
    torch_optimizer = torch.optim.Adam(torch_model.parameters(), lr=1)
    generator = torch.Generator().manual_seed(2022 + local_rank)
    input_data1 = torch.randn(32, 128, generator=generator)
    input_data2 = torch.randn(32, 128, generator=generator)
    checks: dict[str, bool] = {}

    def fwd_bwd_func(no_sync: bool, cur_data: torch.Tensor, number: int) -> None:
        with wrapped.no_sync() if no_sync else nullcontext():
            zero_output = wrapped(cur_data)
            zero_optimizer.backward(zero_output.sum().float())
        with torch_ddp.no_sync() if no_sync else nullcontext():
            torch_output = torch_ddp(cur_data)
            checks[f"{number}: output"] = torch.equal(zero_output, torch_output)
            torch_output.sum().backward()
        # The original checks inside no_sync only; every backward here.
        for (name, p), z1p in zip(
            torch_model.named_parameters(), zero_model.parameters(), strict=True
        ):
            assert p.grad is not None
            same = z1p.grad is not None and torch.equal(p.grad, z1p.grad)
            checks[f"{number} ({'local' if no_sync else 'averaged'}): {name} grad"] = same

    fwd_bwd_func(sync, input_data1, 1)
    fwd_bwd_func(False, input_data2, 2)

    zero_optimizer.step()
    torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 1.0)
    torch_optimizer.step()

    for (name, p), z1p in zip(torch_model.named_parameters(), zero_model.parameters(), strict=True):
        assert_close(p.data, z1p.data)
        checks[f"{name} moved"] = not torch.equal(p.data, initial[name])
    return checks


@pytest.mark.parametrize("sync", [True, False])
def test_zero_1_grad_acc(sync: bool) -> None:
    for checks in run_ranks(_zero_1_grad_acc, 2, sync):
        assert len(checks) == 2 + 2 * 4 + 4
        assert [name for name, ok in checks.items() if not ok] == []
