"""The optimizer step, chunk by chunk, against one step over every shard (see [Note: the step,
chunk by chunk] in engine/optimizer.py): bit for bit at every stage and placement, with
clipping, fp16 overflow, and the optimizers users bring (fused AdamW, the for-loop Adam,
foreach SGD with momentum, HybridAdam).

The reference is the step as it was before: after the same gradient-norm all-reduce, the
inner optimizer steps every shard view in one call (unscaling and clipping all gradient
shards first), then every chunk publishes. Both run in the same process group from the same
seed and batches; only the step differs. Correctness against plain torch loops is held by
test_parity.py, test_gemini.py and test_mixed_precision.py, which run the chunked step too.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, make_model

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.engine.optimizer import ZeroOptimizer
from shardwise.optim import HybridAdam
from shardwise.testing import run_ranks

STEPS = 4
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "fused_adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01),
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=1e-1, momentum=0.9, foreach=True),
    "hybrid_adam": lambda p: HybridAdam(p, lr=1e-2, weight_decay=0.1),
}


def _whole_step(
    self: ZeroOptimizer,
    coef: float,
    grads: list[torch.Tensor | None],
    got_grad: list[bool],
    stepped_early: set[int],
) -> None:
    """The step before it went chunk by chunk: every gradient shard read, then one inner step
    over every view (no chunk stepped during backward here)."""
    assert not stepped_early
    grads = [
        grad if grad is not None else chunk.grads.for_step()
        for chunk, grad in zip(self._chunks, grads, strict=True)
    ]
    for chunk, grad in zip(self._chunks, grads, strict=True):
        for view, begin, end, position in self._slots[chunk.chunk_id]:
            view.grad = grad[begin:end] if got_grad[position] else None
    if isinstance(self.optim, HybridAdam):
        self.optim.step(grad_scale=1.0 / coef)
    else:
        if coef != 1.0:
            torch._foreach_mul_(grads, coef)
        self.optim.step()
    for chunk in self._chunks:
        chunk.publish_master(wait=not self.model.config.defers_param_gather)
        chunk.grads.end_step()


def _train(
    stage: int,
    gemini: dict[str, Any],
    optimizer_name: str,
    max_norm: float,
    fp16: bool,
    whole: bool,
) -> tuple[list[bool], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    rank = dist.get_rank()
    # Stage 3 refuses a branch some ranks skip outside its gather units.
    model = make_model(branch="some_ranks" if stage < 3 else "always")
    config: dict[str, Any] = {"device": torch.device("cpu"), **gemini}
    if fp16:
        config["mixed_precision"] = MixedPrecision(
            param_dtype=torch.float16, compute_dtype=torch.float32
        )
    if stage == 3:
        config.setdefault("chunk_size_numel", CHUNK_NUMEL)
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        OPTIMIZERS[optimizer_name](model.parameters()),
        initial_scale=2**10,
        hysteresis=1,
        max_norm=max_norm,
        optim_config={"reduce_bucket_size": CHUNK_NUMEL} if stage < 3 else None,
    )
    if whole:
        optimizer._step_chunk_by_chunk = types.MethodType(_whole_step, optimizer)  # type: ignore[method-assign]
    taken = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, 2))
        if fp16 and step == 1 and rank == 1:
            loss = loss * 1e30  # fp16 gradients overflow on one rank: the step is skipped
        optimizer.backward(loss)
        taken.append(optimizer.step())
    params = wrapped.state_dict(only_rank_0=False)
    state = {
        f"{name}.{key}": value.clone()
        for name, view in optimizer.shard_views.items()
        for key, value in optimizer.optim.state.get(view, {}).items()
        if isinstance(value, torch.Tensor)
    }
    return taken, params, state


def _compare(cases: list[tuple[Any, ...]]) -> list[str]:
    """Train each case chunk by chunk and whole on this rank; the cases that differ."""
    differ = []
    for case in cases:
        chunked = _train(*case, whole=False)
        whole = _train(*case, whole=True)
        assert chunked[0] == whole[0], case
        for name, (a, b) in {
            "params": (chunked[1], whole[1]),
            "state": (chunked[2], whole[2]),
        }.items():
            assert a.keys() == b.keys(), (case, name)
            if not all(torch.equal(a[k], b[k]) for k in a):
                differ.append(f"{case}: {name}")
    return differ


STAGE3_PLACEMENTS: list[dict[str, Any]] = [
    {"placement_policy": "cuda"},
    {"placement_policy": "cpu"},
    {
        "placement_policy": "static",
        "shard_param_frac": 1.0,
        "offload_param_frac": 0.5,
        "offload_optim_frac": 1.0,
    },
    {"placement_policy": "static", "shard_param_frac": 0.5, "offload_optim_frac": 0.5},
    # A budget that makes "auto" move shards and optimizer sides during the run.
    {"placement_policy": "auto", "device_budget_bytes": 600_000},
]


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_each_optimizer_steps_chunk_by_chunk_as_in_one_step(optimizer_name: str) -> None:
    cases = [
        (stage, gemini, optimizer_name, max_norm, fp16)
        for stage, gemini in [(1, {}), (2, {}), (3, STAGE3_PLACEMENTS[0])]
        # Clipped in fp32; in fp16, one rank's overflow skips a step.
        for max_norm, fp16 in ((0.5, False), (0.0, True))
    ]
    for result in run_ranks(_compare, 2, cases):
        assert result == []


def test_every_stage_3_placement_steps_chunk_by_chunk_as_in_one_step() -> None:
    cases = [
        (3, gemini, "fused_adamw", max_norm, fp16)
        for gemini in STAGE3_PLACEMENTS
        for max_norm, fp16 in ((0.5, False), (0.0, True))
    ]
    for result in run_ranks(_compare, 2, cases):
        assert result == []


def _groups_after_a_failed_step() -> tuple[int, int]:
    model = make_model()
    wrapped = zero_model_wrapper(model, 2, {"device": torch.device("cpu")})
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    optimizer = zero_optim_wrapper(wrapped, inner, optim_config={"reduce_bucket_size": 3001})
    whole = len(inner.param_groups[0]["params"])
    calls = 0
    step = inner.step

    def failing_step(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("the inner optimizer failed")
        return step(*args, **kwargs)

    inner.step = failing_step  # type: ignore[method-assign]
    optimizer.backward(wrapped(*batch_slice(0, 0, dist.get_rank(), 2)))
    with pytest.raises(RuntimeError, match="the inner optimizer failed"):
        optimizer.step()
    return whole, len(inner.param_groups[0]["params"])


def test_the_param_groups_hold_every_view_again_when_a_chunk_step_raises() -> None:
    for whole, after in run_ranks(_groups_after_a_failed_step, 2):
        assert whole > 0 and after == whole
