"""Mixtures of experts whose ranks route tokens to different experts train at stage 3.

Each rank's router decides alone which experts its tokens go to, so on a step one rank runs an
expert another rank does not call at all. The reference is what a user runs without shardwise:
DistributedDataParallel with `find_unused_parameters=True` over the same model, seed and
batches, `optimizer.zero_grad()`, `loss.backward()`, `optimizer.step()`, in the same process
group. Stage 3 gathers each expert block as one unit (see [Note: gather units]).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo  # imported once here, not in every rank that builds DDP
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.engine.config import EngineConfig
from shardwise.runtime.gather_units import find_gather_units
from shardwise.runtime.rank_sync import RanksOutOfStep
from shardwise.testing import run_ranks

WIDTH = 16
NUM_EXPERTS = 4
TOKENS_PER_RANK = 5
STEPS = 6


class TopOneMoE(nn.Module):
    """A top-1 mixture-of-experts feed-forward layer as hand-written ones are: an expert no
    token of this rank chose is not called."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, NUM_EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(NUM_EXPERTS)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(h), dim=-1)
        choice = gate.argmax(dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():
                out[rows] = expert(h[rows]) * gate[rows, e : e + 1]
        return out


class MoEModel(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(layers))
        self.moes = nn.ModuleList(TopOneMoE() for _ in range(layers))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for norm, moe in zip(self.norms, self.moes, strict=True):
            h = h + moe(norm(h))
        return self.head(h)


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + step)
    x = torch.randn(world * TOKENS_PER_RANK, WIDTH, generator=generator)
    target = torch.randn(world * TOKENS_PER_RANK, WIDTH, generator=generator)
    part = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    return x[part], target[part]


def _experts_called(model: MoEModel) -> list[list[int]]:
    """Records, per forward, which experts of each layer this rank called."""
    calls: list[list[int]] = []

    def note(layer: int, expert: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            calls[-1].append(layer * NUM_EXPERTS + expert)

        return hook

    model.register_forward_pre_hook(lambda module, args: calls.append([]))
    for layer, moe in enumerate(model.moes):
        for expert, module in enumerate(moe.experts):
            module.register_forward_pre_hook(note(layer, expert))
    return calls


def _train_plain(steps: int) -> tuple[dict[str, torch.Tensor], list[float], list[list[int]]]:
    torch.manual_seed(0)
    model = MoEModel()
    calls = _experts_called(model)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        x, target = _batch(step, rank, world)
        loss = (ddp(x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return model.state_dict(), losses, calls


def _train_sharded(
    steps: int, config: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], list[float], int]:
    torch.manual_seed(0)
    model = MoEModel()
    wrapped = zero_model_wrapper(model, 3, {"device": torch.device("cpu"), **config})
    optimizer = zero_optim_wrapper(
        wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        x, target = _batch(step, rank, world)
        loss = (wrapped(x) - target).pow(2).mean()
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss.detach()))
    return wrapped.state_dict(only_rank_0=False), losses, len(wrapped.chunk_manager.chunks)


def _compare(config: dict[str, Any]) -> dict[str, Any]:
    reference, plain_losses, calls = _train_plain(STEPS)
    final, losses, num_chunks = _train_sharded(STEPS, config)
    diff = max((final[k] - reference[k]).abs().max().item() for k in reference)
    return {
        "diff": diff,
        "losses": losses,
        "plain_losses": plain_losses,
        "calls": calls,
        "num_chunks": num_chunks,
    }


def _ranks_differed(results: list[dict[str, Any]]) -> bool:
    """Whether on some step one rank called an expert another did not (else nothing is
    proven)."""
    per_rank = [result["calls"] for result in results]
    return any(len({frozenset(calls[step]) for calls in per_rank}) > 1 for step in range(STEPS))


# Several chunks: each expert block spans more than one, and chunks mix experts of a layer
# with the next layer's norm.
SMALL_CHUNKS = {"chunk_size_numel": 1200}


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_routing_apart_match_ddp(world: int) -> None:
    results = run_ranks(_compare, world, SMALL_CHUNKS, timeout_s=300)
    assert results[0]["num_chunks"] >= 4
    _check_against_ddp(results, world)


def _check_against_ddp(results: list[dict[str, Any]], world: int) -> None:
    assert _ranks_differed(results)
    for result in results:
        # Two ranks: DDP's all-reduce and the reduce-scatter add the same two numbers, so the
        # runs agree bit for bit; four add in another order (within float rounding).
        if world == 2:
            assert result["diff"] == 0.0
            assert result["losses"] == result["plain_losses"]
        else:
            assert result["diff"] < 1e-5, result["diff"]


@pytest.mark.parametrize("world, secondary", [(2, 1), (4, 2)])
def test_hpz_with_ranks_routing_apart_matches_ddp(world: int, secondary: int) -> None:
    # hpZ keeps each expert block's slices from forward to backward, whose gathers then run in
    # the secondary groups: every rank gathers the whole unit, so the groups stay in step.
    config = {**SMALL_CHUNKS, "secondary_shard_size": secondary}
    _check_against_ddp(run_ranks(_compare, world, config, timeout_s=300), world)


def test_every_placement_with_overlap_and_buckets() -> None:
    configs = [
        {**SMALL_CHUNKS, "placement_policy": "cpu"},
        {**SMALL_CHUNKS, "placement_policy": "auto", "device_budget_bytes": 1 << 20},
        {**SMALL_CHUNKS, "placement_policy": "static", "offload_optim_frac": 0.5},
        {**SMALL_CHUNKS, "reduce_scatter_bucket_bytes": 8000, "prefetch": False},
    ]

    def run_all() -> list[dict[str, Any]]:
        return [_compare(config) for config in configs]

    results = run_ranks(run_all, 2, timeout_s=300)
    assert _ranks_differed([rank_results[0] for rank_results in results])
    for rank_results in results:
        for config, result in zip(configs, rank_results, strict=True):
            assert result["diff"] == 0.0, (config, result["diff"])


class Checkpointed(nn.Module):
    """One MoE layer behind torch.utils.checkpoint, as activation checkpointing wraps a layer
    (the re-run forward gets leaf inputs when reentrant, and stops early when not), or fed a
    leaf input directly."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.moe = TopOneMoE()
        self.head = nn.Linear(WIDTH, WIDTH)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "leaf_input":
            return self.head(self.moe(x.detach().requires_grad_()) + self.embed(x))
        h = torch.tanh(self.embed(x))
        reentrant = self.mode == "reentrant"
        moe = checkpoint(self.moe, self.norm(h), use_reentrant=reentrant)
        return self.head(h + moe)


def _average_gradients(model: nn.Module) -> None:
    """What DDP with find_unused_parameters=True leaves in `.grad` (which refuses reentrant
    checkpointing of a block whose parameters some passes skip): each gradient averaged over
    ranks, zeros where a rank's did not reach it, None where no rank's did."""
    world = dist.get_world_size()
    for param in model.parameters():
        reached = torch.tensor([float(param.grad is not None)])
        dist.all_reduce(reached)
        if not reached.item():
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        param.grad = grad / world


def _checkpointed(mode: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = Checkpointed(mode)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    torch.manual_seed(0)
    model = Checkpointed(mode)
    wrapped = zero_model_wrapper(model, 3, {"device": torch.device("cpu"), **SMALL_CHUNKS})
    optimizer = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(STEPS):
        x, target = _batch(step, rank, world)
        plain_optimizer.zero_grad()
        (plain(x) - target).pow(2).mean().backward()
        _average_gradients(plain)
        plain_optimizer.step()
        optimizer.zero_grad()
        optimizer.backward((wrapped(x) - target).pow(2).mean())
        optimizer.step()
    final = wrapped.state_dict(only_rank_0=False)
    return {"diff": max((final[k] - v).abs().max().item() for k, v in plain.state_dict().items())}


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "leaf_input"])
def test_a_checkpointed_or_leaf_fed_expert_block_matches_ddp(mode: str) -> None:
    for result in run_ranks(_checkpointed, 2, mode):
        assert result["diff"] == 0.0, result


class Branchy(nn.Module):
    """A block with a data-dependent branch, laid out as no expert block is."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.block = nn.ModuleDict(
            {"inner": nn.Linear(WIDTH, WIDTH), "extra": nn.Linear(WIDTH, WIDTH)}
        )
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = self.block["inner"](h)
        if float(x[0, 0]) > 0:  # differs between ranks
            h = h + self.block["extra"](h)
        return self.head(h)


def _branchy(gather_units: list[str]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = Branchy()
    ddp = DistributedDataParallel(plain, find_unused_parameters=True)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    torch.manual_seed(0)
    model = Branchy()
    # One chunk: the branch's parameters are gathered with the rest, so no gather goes missing
    # and the divergence is found at the next pass check rather than hanging.
    config = {"device": torch.device("cpu"), "chunk_size_numel": 1 << 16}
    wrapped = zero_model_wrapper(model, 3, {**config, "gather_units": gather_units})
    optimizer = zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    branch_taken = []
    try:
        for step in range(STEPS):
            x, target = _batch(step, rank, world)
            branch_taken.append(float(x[0, 0]) > 0)
            plain_optimizer.zero_grad()
            (ddp(x) - target).pow(2).mean().backward()
            plain_optimizer.step()
            optimizer.zero_grad()
            optimizer.backward((wrapped(x) - target).pow(2).mean())
            optimizer.step()
    except RanksOutOfStep as error:
        return {"error": str(error), "branch_taken": branch_taken}
    final = wrapped.state_dict(only_rank_0=False)
    diff = max((final[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    return {"error": None, "diff": diff, "branch_taken": branch_taken}


def test_a_branch_on_some_ranks_outside_units_raises_on_every_rank_naming_it() -> None:
    results = run_ranks(_branchy, 2, [])
    assert results[0]["branch_taken"] != results[1]["branch_taken"]
    for result in results:
        assert result["error"] is not None
        assert "block.extra: ran on rank(s)" in result["error"]
        assert "'gather_units': ['block']" in result["error"]


def test_the_named_block_as_gather_unit_matches_ddp() -> None:
    for result in run_ranks(_branchy, 2, ["block"]):
        assert result["error"] is None
        assert result["diff"] == 0.0


def test_gather_units_are_found_and_bad_ones_refused() -> None:
    model = MoEModel()
    assert list(find_gather_units(model)) == ["moes.0", "moes.1"]
    assert list(find_gather_units(model, ["norms", TopOneMoE])) == ["norms", "moes.0", "moes.1"]
    with pytest.raises(ValueError, match=r"\['nowhere'\] name no module of MoEModel"):
        find_gather_units(model, ["nowhere"])
    with pytest.raises(TypeError, match="a module's qualified name"):
        find_gather_units(model, [3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="gather_units applies to stage 3"):
        EngineConfig(stage=2, device=torch.device("cpu"), gather_units=("moes.0",))
    with pytest.raises(TypeError, match="list of module classes"):
        zero_model_wrapper(model, 3, {"device": torch.device("cpu"), "gather_units": "moes.0"})
