"""ShardedModelV2 / ShardedOptimizerV2 / ZeroInitContext against an unsharded reference."""

from __future__ import annotations

import ctypes
import os
import resource
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import BranchyGPT, Run, batch_slice, max_abs_diff, reference
from torch import nn

from shardwise import (
    BucketTensorShardStrategy,
    CommOp,
    GeminiDDP,
    ShardedModelV2,
    ShardedOptimizerV2,
    TensorShardStrategy,
    ZeroInitContext,
    checkpoint,
    zero_model_wrapper,
)
from shardwise.testing import run_ranks

STRATEGIES = {"tensor": TensorShardStrategy, "bucket": BucketTensorShardStrategy}


def _train(strategy: str, options: dict[str, Any], steps: int = 4) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    with ZeroInitContext(torch.device("cpu"), STRATEGIES[strategy](), seed=0):
        module = BranchyGPT()
    model = ShardedModelV2(module, STRATEGIES[strategy](), **options)
    initial = model.state_dict(only_rank_0=False)
    optimizer = ShardedOptimizerV2(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    )
    losses, gathers, reduces = [], [], []
    for step in range(steps):
        model.comm_stats.reset()
        optimizer.zero_grad()
        loss = model(*batch_slice(step, 0, rank, world))
        optimizer.backward(loss)
        optimizer.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total / world))
        gathers.append(model.comm_stats.calls(CommOp.ALL_GATHER))
        # Gradient reductions: reduce-scatters, or all-reduces less the gradient norm's and
        # the two pass checks at the start of forward and backward (gloo's default, see the
        # note in chunk.py, and [Note: ranks in step] in runtime/rank_sync.py).
        stats = model.comm_stats
        reduces.append(stats.calls(CommOp.REDUCE_SCATTER) + stats.calls(CommOp.ALL_REDUCE) - 3)
    return {
        "initial": initial,
        "losses": losses,
        "state": model.state_dict(only_rank_0=False),
        "gathers": gathers,
        "reduces": reduces,
        "chunks": len(model.chunk_manager.chunks),
    }


@pytest.mark.parametrize("strategy", ["tensor", "bucket"])
@pytest.mark.parametrize(
    "options",
    [{}, {"offload_config": {"device": "cpu"}}, {"gradient_predivide_factor": 2.0}],
    ids=["plain", "offload", "predivide"],
)
def test_two_ranks_match_the_unsharded_reference_exactly(
    strategy: str, options: dict[str, Any]
) -> None:
    ref_losses, ref_state = reference(Run(steps=0))
    ref_losses, ref_final = reference(Run(steps=4))
    for result in run_ranks(_train, 2, strategy, options):
        assert max_abs_diff(result["initial"], ref_state) == 0.0  # same initialisation
        assert result["losses"] == ref_losses
        assert max_abs_diff(result["state"], ref_final) == 0.0


@pytest.mark.parametrize("strategy", ["tensor", "bucket"])
def test_four_ranks(strategy: str) -> None:
    _, ref_state = reference(Run(steps=0, world=4))
    ref_losses, ref_final = reference(Run(steps=4, world=4))
    result = run_ranks(_train, 4, strategy, {"reduce_scatter_bucket_size_mb": 0})[0]
    assert max_abs_diff(result["initial"], ref_state) == 0.0
    # gloo sums four operands in its own order (see test_parity's note on tolerances).
    assert result["losses"] == pytest.approx(ref_losses, abs=1e-5)
    assert max_abs_diff(result["state"], ref_final) < 1e-4


def test_collective_counts_of_the_two_strategies() -> None:
    model = BranchyGPT()
    tensors = len(list(model.parameters()))
    # Modules owning a parameter no earlier module owns (the tied head owns none of its own).
    seen: set[int] = set()
    modules = 0
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        modules += bool(own)
    unbucketed = {"reduce_scatter_bucket_size_mb": 0}
    tensor = run_ranks(_train, 2, "tensor", unbucketed)[0]
    bucket = run_ranks(_train, 2, "bucket", unbucketed)[0]
    bucketed = run_ranks(_train, 2, "tensor", {"reduce_scatter_bucket_size_mb": 25})[0]
    assert tensor["chunks"] == tensors and bucket["chunks"] == modules
    # Once the order is recorded: a gather per chunk in forward and in backward, except the
    # never-used branch's chunks, which are never gathered, and the chunk backward starts
    # with (the tied head's), kept gathered from the end of forward.
    assert tensor["gathers"][-1] == 2 * (tensors - 2) - 1
    assert bucket["gathers"][-1] == 2 * (modules - 1) - 1
    assert tensor["reduces"][-1] == tensors and bucket["reduces"][-1] == modules
    # Bucketed reduce-scatter: the whole (small) model's gradients in one call.
    assert bucketed["reduces"][-1] == 1
    assert bucketed["losses"] == tensor["losses"]


def _fp16(strategy: str) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    with ZeroInitContext(
        torch.device("cpu"), STRATEGIES[strategy](), seed=0, default_dtype=torch.float16
    ):
        module = BranchyGPT()
    model = ShardedModelV2(module, STRATEGIES[strategy](), fp32_reduce_scatter=True)
    optimizer = ShardedOptimizerV2(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        initial_scale=2**8,
    )
    losses = []
    for step in range(3):
        optimizer.zero_grad()
        loss = model(*batch_slice(step, 0, rank, world))
        optimizer.backward(loss)
        assert optimizer.step(), "no step may overflow at this loss scale"
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total / world))
    assert optimizer.loss_scale == 2**8  # fp16 parameters: the dynamic scaler is in use
    return losses


def test_fp16_parameters_with_fp32_reduce_scatter_track_the_fp32_reference() -> None:
    ref_losses, _ = reference(Run(steps=3))
    for losses in run_ranks(_fp16, 2, "bucket"):
        # fp16 computation: about three decimal digits.
        assert losses == pytest.approx(ref_losses, rel=2e-2)


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _build_peak(sharded: bool, layers: int, width: int) -> dict[str, int]:
    # Serve every large allocation with its own mapping, returned to the system when freed,
    # so the process's peak resident size follows the peak of live tensors (glibc otherwise
    # raises this threshold after the first free and keeps freed blocks in its heap).
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    before = _rss_bytes()

    def build() -> nn.Module:
        return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))

    if sharded:
        with ZeroInitContext(torch.device("cpu"), TensorShardStrategy(), seed=0):
            model = build()
    else:
        model = build()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del model
    return {"growth": peak - before}


def test_building_in_the_context_stays_under_a_memory_cap() -> None:
    layers, width = 32, 1024  # 32 x 4 MiB = 128 MiB of fp32 parameters
    full = layers * width * width * 4
    cap = int(full * 0.75)  # below the whole model, above half of it plus one layer
    for result in run_ranks(_build_peak, 2, True, layers, width):
        assert result["growth"] < cap, (result, cap)
    # The same model built plainly passes the cap: the measurement can fail.
    for result in run_ranks(_build_peak, 2, False, layers, width):
        assert result["growth"] > cap, (result, cap)


def _reuse(reuse: bool, accumulate: bool) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    with ZeroInitContext(
        torch.device("cpu"), BucketTensorShardStrategy(), seed=0, default_dtype=torch.float16
    ):
        module = BranchyGPT()
    model = ShardedModelV2(module, BucketTensorShardStrategy(), reuse_fp16_shard=reuse)
    optimizer = ShardedOptimizerV2(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), initial_scale=2**8
    )
    losses, grad_bytes = [], []
    for step in range(3):
        optimizer.zero_grad()
        for _ in range(2 if accumulate else 1):
            loss = model(*batch_slice(step, 0, rank, world))
            optimizer.backward(loss)
        grad_bytes.append(model.memory_report()["grads"])
        optimizer.step()
        losses.append(float(loss.detach().float()))
    return {"losses": losses, "grad_bytes": grad_bytes, "state": model.state_dict()}


def _accumulate_with_reuse() -> str:
    with pytest.raises(ValueError, match="reuse_fp16_shard") as info:
        _reuse(True, accumulate=True)
    return str(info.value)


def test_reuse_fp16_shard_keeps_gradients_in_the_parameter_shard() -> None:
    reused = run_ranks(_reuse, 2, True, False)[0]
    plain = run_ranks(_reuse, 2, False, False)[0]
    assert reused["losses"] == plain["losses"]
    assert max_abs_diff(reused["state"], plain["state"]) == 0.0
    # No fp32 gradient shard between backward and step: only what the payload already holds.
    assert all(b == 0 for b in reused["grad_bytes"])
    assert all(b > 0 for b in plain["grad_bytes"])
    # ... and so no gradient accumulation, refused on every rank alike.
    messages = run_ranks(_accumulate_with_reuse, 2)
    assert all("call step() after every backward" in m for m in messages)


def test_arguments_that_cannot_be_honoured_are_refused() -> None:
    module = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="reuse_fp16_shard=True needs 16-bit parameters"):
        ShardedModelV2(module, TensorShardStrategy(), reuse_fp16_shard=True)
    with pytest.raises(ValueError, match="offload_config"):
        ShardedModelV2(module, TensorShardStrategy(), offload_config={"device": "nvme"})
    with pytest.raises(TypeError, match="shard_strategy"):
        ShardedModelV2(module, "tensor")  # type: ignore[arg-type]


def _save_sharded_v2(path: str) -> dict[str, torch.Tensor]:
    result = _train("bucket", {}, steps=2)
    with ZeroInitContext(torch.device("cpu"), TensorShardStrategy(), seed=0):
        module = BranchyGPT()
    model = ShardedModelV2(module, TensorShardStrategy())
    model.load_state_dict(result["state"])
    checkpoint.save(path, model, extra={"strategy": "tensor"})
    state: dict[str, torch.Tensor] = result["state"]
    return state


def _load_into_stage_2(path: str) -> dict[str, torch.Tensor]:
    model = zero_model_wrapper(BranchyGPT(), 2, {"device": torch.device("cpu")})
    assert checkpoint.load(path, model) == {"strategy": "tensor"}
    return model.state_dict()


def test_checkpoint_from_sharded_model_v2_loads_elsewhere(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_sharded_v2, 2, path)[0]
    loaded = run_ranks(_load_into_stage_2, 1, path)[0]
    assert max_abs_diff(saved, loaded) == 0.0


def _colossalai_signature() -> dict[str, Any]:
    messages: list[str] = []

    def expect(kind: type[Exception], pattern: str, fn: Any) -> None:
        with pytest.raises(kind, match=pattern) as info:
            fn()
        messages.append(str(info.value))

    def linear(**options: Any) -> ShardedModelV2:
        torch.manual_seed(0)
        return ShardedModelV2(nn.Linear(4, 4), TensorShardStrategy(), **options)

    model = linear()

    def sgd(on: nn.Module = model) -> torch.optim.Optimizer:
        return torch.optim.SGD(on.parameters(), lr=0.1)

    # ColossalAI's whole signature, positionally: gpu_margin_mem_ratio comes third.
    optimizer = ShardedOptimizerV2(
        model, sgd(), 0.0, 2**16, 1, 2, 0.5, 1000, 2, 2**32, dist.group.WORLD, None, False
    )
    expect(
        ValueError,
        r"gpu_margin_mem_ratio=0.5 has no meaning here: without offload_config",
        lambda: ShardedOptimizerV2(model, sgd(), 0.5),
    )
    expect(
        ValueError,
        r"gpu_margin_mem_ratio must be a number in \[0, 1\], got 1.5",
        lambda: ShardedOptimizerV2(model, sgd(), gpu_margin_mem_ratio=1.5),
    )
    offloaded = linear(offload_config={"device": "cpu"})
    expect(
        ValueError,
        "use_memory_tracer=True",
        lambda: ShardedOptimizerV2(offloaded, sgd(offloaded), gpu_margin_mem_ratio=0.5),
    )
    traced = linear(offload_config={"device": "cpu"}, use_memory_tracer=True)
    expect(
        ValueError,
        r"needs the device's capacity.*device_budget_bytes",
        lambda: ShardedOptimizerV2(traced, sgd(traced), gpu_margin_mem_ratio=0.5),
    )
    expect(
        ValueError,
        "mp_process_group must be None",
        lambda: ShardedOptimizerV2(model, sgd(), mp_process_group=dist.group.WORLD),
    )
    other_group = dist.new_group([0, 1])
    expect(
        ValueError,
        "dp_process_group must be None or the ShardedModelV2's process_group",
        lambda: ShardedOptimizerV2(model, sgd(), dp_process_group=other_group),
    )
    expect(TypeError, "verbose must be a bool", lambda: ShardedOptimizerV2(model, sgd(), verbose=1))
    ignored = nn.Linear(4, 4)
    GeminiDDP.set_params_to_ignore([ignored.bias])
    expect(
        ValueError,
        r"\['bias'\] are marked by set_params_to_ignore",
        lambda: ShardedModelV2(ignored, TensorShardStrategy()),
    )
    return {
        "messages": messages,
        "scale": optimizer.loss_scale,
        "full": model.state_dict(),
        "rank0": model.state_dict(only_rank_0=True),
    }


def test_sharded_optimizer_v2_takes_colossalai_signature_and_refuses_what_it_cannot_honour() -> (
    None
):
    results = run_ranks(_colossalai_signature, 2)
    torch.manual_seed(0)
    plain = nn.Linear(4, 4).state_dict()
    for rank, result in enumerate(results):
        assert len(result["messages"]) == 8
        assert result["scale"] == 1.0  # fp32 parameters: no loss scaling to do
        # The whole state on every rank by default; the rank-0-only mode stays available.
        assert max_abs_diff(result["full"], plain) == 0.0
        assert (result["rank0"] == {}) == (rank != 0)
        if rank == 0:
            assert max_abs_diff(result["rank0"], plain) == 0.0


def _verbose_logs(caplog: Any) -> int:
    model = ShardedModelV2(nn.Linear(4, 4), TensorShardStrategy())
    optimizer = ShardedOptimizerV2(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=True)
    optimizer.backward(model(torch.ones(2, 4)).sum())
    with caplog.at_level("DEBUG", logger="shardwise.sharded_v2"):
        optimizer.step()
    return sum("ShardedOptimizerV2" in r.getMessage() for r in caplog.records)


def test_verbose_logs_memory_around_each_step(caplog: pytest.LogCaptureFixture) -> None:
    assert run_ranks(_verbose_logs, 1, caplog) == [2]
