"""ColoDDP (stage 0 of the chunk engine) against torch's DistributedDataParallel.

The reference is what a user runs without shardwise: `DistributedDataParallel(model,
find_unused_parameters=True)` on a copy of the same model in the same process group, with the
same seed and the same batches per rank, `optimizer.zero_grad()`, backward, `clip_grad_norm_`
and a plain torch optimizer's step. Each rank builds its model from its own seed: both wrappers
must start every rank from rank 0's parameters and buffers. The model has a branch used on some
ranks only (in one step on none), a layer never used, a frozen layer and a tied weight; one step
accumulates two backward passes.

fp32 results are bit-identical wherever the all-reduced buffers are laid out as DDP's: with 2
ranks always (a + b is commutative), with 4 ranks when one chunk holds the model as DDP's one
bucket does. Otherwise gloo sums the four ranks' values in an order that depends on an
element's position in the buffer (measured: 4 of 1000 elements differ in the last bit between
a buffer all-reduced alone and with 7 elements after it), so several chunks give last-bit
differences in gradients, which Adam and clipping carry into parameters (measured: 5.4e-8 at
most after 5 steps): losses and parameters are compared to 1e-6 then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch._dynamo  # imported once here, not in every rank that builds DDP
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise import ColoDDP, CommOp
from shardwise.testing import run_ranks

WIDTH = 24
ROWS_PER_RANK = 4
STEPS = 5
ACCUMULATED_STEP = 2  # two backward passes without zero_grad() between
MAX_NORM = 0.5
SEVERAL_CHUNKS_MB = 0.004  # 1048 fp32 elements: a few layers per chunk


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.body = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )
        self.some_ranks = nn.Linear(WIDTH, WIDTH)
        self.never = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.rand(WIDTH) + 0.5)
        # Called in backward once every layer after `embed` is done, before `embed` itself.
        self.probe: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        h = torch.tanh(self.embed(x)) * self.scale
        if self.probe is not None:
            probe = self.probe
            h.register_hook(lambda grad: probe())
        h = self.frozen(h)
        h = h + self.body(h)
        if branch:
            h = h + self.some_ranks(h)
        return self.head(h)


def _uses_branch(step: int, rank: int) -> bool:
    # Every other rank each step (rank 0 not at step 0), and no rank at step 3, after the
    # branch got gradients before.
    return step != 3 and (step + rank) % 2 == 1


def _batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(world * ROWS_PER_RANK, WIDTH, generator=generator)
    target = torch.randn(world * ROWS_PER_RANK, WIDTH, generator=generator)
    part = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return x[part], target[part]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
}


@dataclass(frozen=True)
class Case:
    optim: str
    bucket_cap_mb: float = 25  # one chunk: the model is far below it
    rebuild_bucket: bool = True
    set_to_none: bool = True


@dataclass
class Trace:
    """What one training run showed on this rank."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor | None]]  # per step, after backward, before clipping
    initial: dict[str, torch.Tensor]  # once wrapped
    params: dict[str, torch.Tensor]


def _train(
    case: Case, wrap: Callable[[nn.Module], nn.Module], group: Any, inspect: Callable[[], None]
) -> Trace:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # Every rank its own initial values (by global rank): the wrapper syncs them.
    torch.manual_seed(dist.get_rank())
    plain = Branchy()
    model = wrap(plain)
    optimizer = OPTIMIZERS[case.optim]([p for p in plain.parameters() if p.requires_grad])
    trace = Trace([], [], _copy(plain.state_dict()), {})
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=case.set_to_none)
        passes = 2 if step == ACCUMULATED_STEP else 1
        for micro in range(passes):
            x, target = _batch(step, micro, rank, world)
            loss = (model(x, _uses_branch(step, rank)) - target).pow(2).mean() / passes
            loss.backward()
            trace.losses.append(float(loss.detach()))
            inspect()
        trace.grads.append(
            {
                name: None if p.grad is None else p.grad.clone()
                for name, p in plain.named_parameters()
            }
        )
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    trace.params = _copy(plain.state_dict())
    return trace


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def _colo_ddp_run(case: Case, group: Any) -> tuple[Trace, dict[str, Any]]:
    """The ColoDDP run, checking after every backward that `.grad` views the chunks and that
    the averaging went through counted collectives."""
    checks: dict[str, Any] = {
        "grads viewing their chunk": 0,
        "grads elsewhere": 0,
        "all_reduce per backward": [],
        "all_reduce before embed's backward": [],
    }
    holder: list[ColoDDP] = []

    def wrap(module: nn.Module) -> nn.Module:
        holder.append(
            ColoDDP(
                module, group, bucket_cap_mb=case.bucket_cap_mb, rebuild_bucket=case.rebuild_bucket
            )
        )
        model = holder[0]
        stats = model.comm_stats
        module.probe = lambda: checks["all_reduce before embed's backward"].append(
            stats.calls(CommOp.ALL_REDUCE) - before["all_reduce"]
        )
        checks["trainable chunks"] = len(list(model.chunk_manager.trainable_chunks()))
        checks["broadcast bytes sent at wrap"] = stats.sent_bytes(CommOp.BROADCAST)
        checks["broadcasts at wrap"] = stats.calls(CommOp.BROADCAST)
        checks["model bytes"] = sum(
            4 * t.numel() for t in [*module.parameters(), *module.buffers()]
        )
        return model

    before = {"all_reduce": 0, "payload": 0}

    def inspect() -> None:
        model = holder[0]
        stats = model.comm_stats
        for param in model.parameters():
            if param.grad is None:
                continue
            chunk, index = model.chunk_manager.locate(param)
            assert chunk.grads.full is not None
            offset = chunk.tensors[index].offset
            view = (
                param.grad.untyped_storage().data_ptr()
                == chunk.grads.full.untyped_storage().data_ptr()
                and param.grad.data_ptr() == chunk.grads.full[offset:].data_ptr()
            )
            checks["grads viewing their chunk" if view else "grads elsewhere"] += 1
        calls, payload = stats.calls(CommOp.ALL_REDUCE), stats.payload_bytes(CommOp.ALL_REDUCE)
        checks["all_reduce per backward"].append(
            (calls - before["all_reduce"], payload - before["payload"])
        )
        before.update(all_reduce=calls, payload=payload)

    trace = _train(case, wrap, group, inspect)
    model = holder[0]
    stats = model.comm_stats
    checks["sharding collectives"] = stats.calls(CommOp.REDUCE_SCATTER) + stats.calls(
        CommOp.ALL_GATHER
    )
    checks["broadcasts after wrap"] = stats.calls(CommOp.BROADCAST) - checks["broadcasts at wrap"]
    chunks = list(model.chunk_manager.trainable_chunks())
    checks["gradient bytes"] = sum(4 * c.numel for c in chunks)
    checks["tensors"] = sum(len(c.tensors) for c in chunks)
    checks["names"] = [name for name, _ in model.named_parameters()]
    checks["state dict keys"] = list(model.state_dict())
    return trace, checks


def _ddp_run(case: Case, group: Any) -> Trace:
    def wrap(module: nn.Module) -> nn.Module:
        return DistributedDataParallel(module, process_group=group, find_unused_parameters=True)

    return _train(case, wrap, group, lambda: None)


def _compare(cases: list[Case], groups: list[list[int]] | None = None) -> list[dict[str, Any]]:
    group = None
    if groups is not None:  # every rank builds every group; each trains in its own
        built = [dist.new_group(ranks) for ranks in groups]
        group = next(g for g, ranks in zip(built, groups, strict=True) if dist.get_rank() in ranks)
    results = []
    for case in cases:
        theirs = _ddp_run(case, group)
        mine, checks = _colo_ddp_run(case, group)
        diffs = {k: float((mine.params[k] - v).abs().max()) for k, v in theirs.params.items()}
        same_grads = all(
            (a is None) == (b is None) and (a is None or b is None or torch.equal(a, b))
            for ours, ref in zip(mine.grads, theirs.grads, strict=True)
            for a, b in zip(ours.values(), ref.values(), strict=True)
        )
        none_where = [
            sorted(name for name, g in grads.items() if g is None) for grads in mine.grads
        ]
        ref_none_where = [
            sorted(name for name, g in grads.items() if g is None) for grads in theirs.grads
        ]
        results.append(
            {
                "case": case,
                "losses": (mine.losses, theirs.losses),
                "max diff": max(diffs.values()),
                "same grads": same_grads,
                "none where": (none_where, ref_none_where),
                "checks": checks,
                "group rank": dist.get_rank(group),
                "state keys": list(theirs.params),
                "checksum": float(sum(v.double().sum() for v in mine.params.values())),
                "moved": sorted(
                    k for k, v in mine.params.items() if not torch.equal(v, mine.initial[k])
                ),
            }
        )
    return results


def _check(results: list[list[dict[str, Any]]], exact: bool) -> None:
    for rank_results in results:
        for result in rank_results:
            case, checks = result["case"], result["checks"]
            ours, theirs = result["losses"]
            none_where, ref_none_where = result["none where"]
            assert none_where == ref_none_where, case
            # Nothing flowed into the never-used layer, nor into the branch at step 3.
            assert all("never.weight" in names for names in none_where), none_where
            if case.set_to_none:
                assert "some_ranks.weight" in none_where[3], none_where
            assert "some_ranks.weight" not in none_where[0], none_where  # rank 1's reached
            if exact:
                assert ours == theirs, case
                assert result["same grads"], case
                assert result["max diff"] == 0.0, (case, result["max diff"])
            else:
                assert ours == pytest.approx(theirs, abs=1e-6), case
                assert result["max diff"] < 1e-6, (case, result["max diff"])
            # Every trained layer moved; the never-used and the frozen ones kept their values.
            assert result["moved"] == sorted(
                k
                for k in result["state keys"]
                if k.split(".")[0] not in {"never", "frozen", "scale"}
            ), result["moved"]
            assert checks["grads elsewhere"] == 0, case
            assert checks["grads viewing their chunk"] > 0, case
            # One all-reduce per chunk and one of the flags saying which tensors some rank's
            # gradient reached, after every backward; nothing else is sharded or gathered.
            per_backward = (
                checks["trainable chunks"] + 1,
                checks["gradient bytes"] + 4 * checks["tensors"],
            )
            assert checks["all_reduce per backward"] == [per_backward] * (STEPS + 1), case
            assert checks["sharding collectives"] == 0, case
            # Chunks are averaged during backward as they complete, in one order on every
            # rank. rebuild_bucket: after the first backward that order is the one in which
            # chunks completed there on rank 0 (the branch's and the never-used layer's chunks
            # last: rank 0 skipped the branch), so the chunks of the layers after `embed` are
            # launched before its gradient. Without it the last chunk, which holds the
            # never-used layer, goes first and holds the others back until backward ends.
            launched_early = checks["all_reduce before embed's backward"][1:]
            if checks["trainable chunks"] > 2:
                if case.rebuild_bucket:
                    assert all(n > 0 for n in launched_early), launched_early
                else:
                    assert launched_early == [0] * STEPS, launched_early
            # Rank 0 sent the whole model at wrap time, the others nothing.
            sent = checks["broadcast bytes sent at wrap"]
            assert sent == (checks["model bytes"] if result["group rank"] == 0 else 0), case
            # rebuild_bucket: rank 0's order of completion is broadcast once, after the first
            # backward; without it the order stays and nothing is sent.
            assert checks["broadcasts after wrap"] == int(case.rebuild_bucket), case
            # The inner module's names, no "module." prefix.
            assert checks["names"] == [name for name, _ in Branchy().named_parameters()]
            assert checks["state dict keys"] == result["state keys"]


def test_two_ranks_bit_exact_with_ddp() -> None:
    cases = [
        Case("adamw_fused"),
        Case("sgd", bucket_cap_mb=SEVERAL_CHUNKS_MB, rebuild_bucket=False, set_to_none=False),
        Case("adamw_fused", bucket_cap_mb=SEVERAL_CHUNKS_MB),
    ]
    results = run_ranks(_compare, 2, cases)
    _check(results, exact=True)
    assert results[0][0]["checks"]["trainable chunks"] == 1
    assert results[0][2]["checks"]["trainable chunks"] > 2


def test_four_ranks_bit_exact_with_one_chunk() -> None:
    _check(run_ranks(_compare, 4, [Case("adamw_fused"), Case("sgd")]), exact=True)


def test_four_ranks_several_chunks() -> None:
    # Last-bit differences (see the module's docstring): gloo's order of summing four ranks'
    # values depends on where an element sits in the all-reduced buffer, and the chunks are
    # laid out unlike DDP's one bucket.
    cases = [Case("adamw_fused", bucket_cap_mb=SEVERAL_CHUNKS_MB), Case("sgd", SEVERAL_CHUNKS_MB)]
    _check(run_ranks(_compare, 4, cases), exact=False)


def test_a_process_group_of_its_own() -> None:
    # Two data-parallel groups of 2 ranks in a world of 4, each training on its own from its
    # rank 0's initial values (global ranks 0 and 2).
    results = run_ranks(
        _compare, 4, [Case("adamw_fused"), Case("sgd", SEVERAL_CHUNKS_MB)], [[0, 1], [2, 3]]
    )
    _check(results, exact=True)
    checksums = [[result["checksum"] for result in rank_results] for rank_results in results]
    assert checksums[0] == checksums[1] != checksums[2] == checksums[3]


def _no_sync_run(colo: bool) -> dict[str, Any]:
    """Steps of three micro-batches, the first two under `no_sync()` (DDP's pattern for
    gradient accumulation); the branch runs on some ranks in some micro-batches only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    plain = Branchy()
    if colo:
        model: Any = ColoDDP(plain, bucket_cap_mb=SEVERAL_CHUNKS_MB)
    else:
        model = DistributedDataParallel(plain, find_unused_parameters=True)
    optimizer = OPTIMIZERS["adamw_fused"]([p for p in plain.parameters() if p.requires_grad])
    local_grads, averaged_grads, quiet = [], [], []
    for step in range(3):
        optimizer.zero_grad()
        for micro in range(3):
            x, target = _batch(step, micro, rank, world)
            branch = (step + micro + rank) % 3 == 0
            if micro < 2:
                # Forward and backward inside, as DDP needs (it decides in forward).
                before = model.comm_stats.snapshot() if colo else None
                with model.no_sync():
                    ((model(x, branch) - target).pow(2).mean() / 3).backward()
                if colo:
                    quiet.append(model.comm_stats.snapshot() == before)
                local_grads.append(
                    {
                        n: None if p.grad is None else p.grad.clone()
                        for n, p in plain.named_parameters()
                    }
                )
            else:
                ((model(x, branch) - target).pow(2).mean() / 3).backward()
        averaged_grads.append(
            {n: None if p.grad is None else p.grad.clone() for n, p in plain.named_parameters()}
        )
        optimizer.step()
    return {
        "local": local_grads,
        "averaged": averaged_grads,
        "quiet": quiet,
        "params": _copy(plain.state_dict()),
    }


def _same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> bool:
    return all(
        (a[k] is None) == (b[k] is None) and (a[k] is None or torch.equal(a[k], b[k]))  # type: ignore[arg-type]
        for k in a
    )


def test_no_sync_accumulates_locally_as_ddp_does() -> None:
    def both() -> dict[str, Any]:
        return {"ddp": _no_sync_run(colo=False), "colo": _no_sync_run(colo=True)}

    for result in run_ranks(both, 2):
        ddp, colo = result["ddp"], result["colo"]
        assert colo["quiet"] and all(colo["quiet"])  # no collective inside no_sync()
        assert all(_same(a, b) for a, b in zip(colo["local"], ddp["local"], strict=True))
        assert all(_same(a, b) for a, b in zip(colo["averaged"], ddp["averaged"], strict=True))
        for key, value in ddp["params"].items():
            assert torch.equal(colo["params"][key], value), key
