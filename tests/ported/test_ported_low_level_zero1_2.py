"""Ported from hpcaitech/ColossalAI, tests/test_zero/test_low_level/test_zero1_2.py.

An MLP (123 -> 253 -> 512, plus a layer `linear_drop` the forward never uses), each rank its
own batch. Kept:
- `exam_zero_1_torch_ddp`: ZeRO stage 1 against torch DDP over the same model, SGD at lr 1,
  two iterations: the outputs, each parameter's gradient after backward (None for
  `linear_drop`, whose DDP `.grad` stays None) and the parameters after the step agree.
- `exam_zero_1_2`: stage 1 against stage 2 (`partition_grad=True`), Adam at lr 1, one
  iteration: the outputs, the averaged gradients (`get_param_grad`) and the parameters after the
  step agree.

Translated: `LowLevelZeroOptimizer(optimizer, ...)` is `zero_model_wrapper(model, stage)` with
`zero_optim_wrapper(..., optim_config={"reduce_bucket_size", "overlap_communication"})`;
`zero_optimizer.get_param_grad(p)` is stage 1's `p.grad` (the comparison this port exists for:
ColossalAI's `p.grad` is None after a synchronised backward, ours is DDP's averaged gradient,
see [Note: stage 1 averages in backward] in chunk/grads.py) and `model.full_grads()` at stage
2, whose `p.grad` stays None; `_force_wait_all_gather()` is `model.wait_param_gathers()`.

Deliberate differences:
- fp32 on CPU (gloo) with 2 ranks instead of fp16 / bf16 on 4 GPUs, so every comparison is
  exact (`torch.equal`) where the original allows fp16 / bf16 tolerances: each averaged element
  is (a + b) / 2 in both engines. `initial_scale`, `master_weights` (fp32 parameters are their
  own masters here) and the fp16 / bf16 / fp8 parametrisations have nothing to do in fp32;
  fp8 communication (quantized gathers, not exact by design) is tested against the
  unquantized engine in tests/test_wire_formats.py.
- `extra_dp_size=2` (a second data-parallel group of 2 over 4 ranks) is our hybrid sharding,
  `shard_size=2` on 4 ranks: there the average crosses the shard groups as shards only, so
  stage 1's `p.grad` stays None as at stage 2 and the averaged gradient is `full_grads()`,
  compared with DDP over the 4 ranks to 1e-6 relative (DDP sums the 4 ranks in one
  all-reduce, hybrid sharding within each group, then across: another association).
- ColossalAI's loop never calls `zero_grad()`, so its second iteration accumulates onto the
  first's gradients in both engines. Our stage 1 refuses a backward after `step()` until
  `zero_grad()` (the step may unscale or clip this rank's slice of the averaged buffer in
  place), so both loops here call `zero_grad()` first, as users write them.
- Each case also runs with a bucket of 40,000 elements, so that the model spans several
  chunks (buckets), some padded.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch._dynamo  # imported once here, not in every rank that builds DDP
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import run_ranks

CPU = torch.device("cpu")
BUCKETS = (1024 * 1024, 40_000)  # the original's reduce_bucket_size, and several chunks


class MlpModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(123, 253)
        self.linear_drop = nn.Linear(253, 253)
        self.linear2 = nn.Linear(253, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear1(x)
        x = self.linear2(x)
        return x


def _zero(
    model: nn.Module,
    stage: int,
    optimizer: type[torch.optim.Optimizer],
    bucket: int,
    shard_size: int | None = None,
) -> tuple[Any, Any]:
    wrapped = zero_model_wrapper(model, stage, {"device": CPU, "shard_size": shard_size})
    zero_optimizer = zero_optim_wrapper(
        wrapped,
        optimizer(model.parameters(), lr=1),
        optim_config={"reduce_bucket_size": bucket, "overlap_communication": True},
    )
    return wrapped, zero_optimizer


def _same(mine: torch.Tensor | None, theirs: torch.Tensor | None) -> bool:
    if theirs is None:
        return mine is None
    return mine is not None and torch.equal(mine, theirs)


def _close(mine: torch.Tensor | None, theirs: torch.Tensor | None) -> bool:
    if theirs is None:
        return mine is None
    return mine is not None and torch.allclose(mine, theirs, rtol=1e-6, atol=1e-7)


def _zero_1_torch_ddp(shard_size: int | None) -> dict[str, bool]:
    """exam_zero_1_torch_ddp, for each bucket size; with `shard_size` the extra_dp case."""
    rank = dist.get_rank()
    hybrid = shard_size is not None
    checks: dict[str, bool] = {}
    for bucket in BUCKETS:
        torch.manual_seed(1453)
        torch_model = MlpModel()
        zero_model = copy.deepcopy(torch_model)
        ddp = DistributedDataParallel(torch_model, static_graph=True)
        wrapped, zero_optimizer = _zero(zero_model, 1, torch.optim.SGD, bucket, shard_size)
        torch_optimizer = torch.optim.SGD(torch_model.parameters(), lr=1)
        generator = torch.Generator().manual_seed(1453 + rank)
        for it in range(2):
            where = f"bucket {bucket}, iteration {it}"
            input_data = torch.rand(32, 123, generator=generator)
            zero_optimizer.zero_grad()
            torch_optimizer.zero_grad()
            zero_output = wrapped(input_data)
            torch_output = ddp(input_data)
            compare = _close if hybrid else _same
            checks[f"{where}: output"] = compare(zero_output, torch_output)
            zero_optimizer.backward(zero_output.mean())
            torch_output.mean().backward()
            averaged = wrapped.full_grads()
            for (name, p), z1p in zip(
                torch_model.named_parameters(), zero_model.parameters(), strict=True
            ):
                if hybrid:
                    checks[f"{where}: {name} .grad None"] = z1p.grad is None
                    checks[f"{where}: {name} grad"] = _close(averaged[name], p.grad)
                else:
                    checks[f"{where}: {name} .grad"] = _same(z1p.grad, p.grad)
                    checks[f"{where}: {name} full_grads"] = _same(averaged[name], p.grad)
            zero_optimizer.step()
            torch_optimizer.step()
            wrapped.wait_param_gathers()
            for (name, p), z1p in zip(
                torch_model.named_parameters(), zero_model.parameters(), strict=True
            ):
                checks[f"{where}: {name} updated"] = compare(z1p.detach(), p.detach())
    return checks


def test_zero_1_torch_ddp() -> None:
    for checks in run_ranks(_zero_1_torch_ddp, 2, None):
        assert len(checks) == 2 * 2 * (1 + 6 * 2 + 6)
        assert [name for name, ok in checks.items() if not ok] == []


def test_zero_1_torch_ddp_extra_dp_as_hybrid_sharding() -> None:
    for checks in run_ranks(_zero_1_torch_ddp, 4, 2, timeout_s=180):
        assert [name for name, ok in checks.items() if not ok] == []


def _zero_1_2() -> dict[str, Any]:
    """exam_zero_1_2, for each bucket size."""
    rank = dist.get_rank()
    checks: dict[str, Any] = {}
    for bucket in BUCKETS:
        torch.manual_seed(2001)
        zero1_model = MlpModel()
        zero2_model = copy.deepcopy(zero1_model)
        initial = zero1_model.linear1.weight.detach().clone()
        wrapped1, zero1_optimizer = _zero(zero1_model, 1, torch.optim.Adam, bucket)
        wrapped2, zero2_optimizer = _zero(zero2_model, 2, torch.optim.Adam, bucket)
        generator = torch.Generator().manual_seed(2001 + rank)
        input_data = torch.randn(32, 123, generator=generator)
        zero1_output = wrapped1(input_data)
        zero2_output = wrapped2(input_data)
        checks[f"{bucket}: output"] = torch.equal(zero1_output, zero2_output)
        zero1_optimizer.backward(zero1_output.mean().float())
        zero2_optimizer.backward(zero2_output.mean().float())
        g1, g2 = wrapped1.full_grads(), wrapped2.full_grads()
        for name, p1 in zero1_model.named_parameters():
            checks[f"{bucket}: {name} grad"] = _same(g1[name], g2[name])
            checks[f"{bucket}: {name} stage 1 .grad"] = _same(p1.grad, g2[name])
        checks[f"{bucket}: stage 2 .grad None"] = all(
            p.grad is None for p in zero2_model.parameters()
        )
        checks[f"{bucket}: linear_drop no grad"] = g2["linear_drop.weight"] is None
        zero1_optimizer.step()
        zero2_optimizer.step()
        state1 = wrapped1.state_dict(only_rank_0=False)
        state2 = wrapped2.state_dict(only_rank_0=False)
        for name in state1:
            checks[f"{bucket}: {name} updated"] = torch.equal(state1[name], state2[name])
        # Adam at lr 1 moved every used parameter by about 1: the step did something.
        moved = (state1["linear1.weight"] - initial).abs().mean()
        checks[f"{bucket}: moved"] = math.isfinite(float(moved)) and float(moved) > 0.1
    return checks


def test_zero_1_2() -> None:
    for checks in run_ranks(_zero_1_2, 2):
        assert [name for name, ok in checks.items() if not ok] == []
