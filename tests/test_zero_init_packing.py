"""Wrapping a model built in ZeroInitContext at stage 3 never makes the whole model exist on a
rank: each parameter is made whole just before it is packed and each chunk is sharded as soon
as it is full. The chunks and the numbers are those of the same model built plainly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import shardwise.comm
from shardwise import (
    CommOp,
    TensorShardStrategy,
    ZeroInitContext,
    zero_model_wrapper,
    zero_optim_wrapper,
)
from shardwise.testing import run_ranks

CPU = torch.device("cpu")
LAYERS, WIDTH = 8, 96
LAYER_NUMEL = WIDTH * WIDTH + WIDTH  # weight and bias: one layer fills one chunk
LAYER_BYTES = LAYER_NUMEL * 4


@contextmanager
def _whole_bytes_peak(module: nn.Module, peak: list[int]) -> Iterator[None]:
    """Record in `peak[0]` the most bytes of whole parameter data seen alive while the block
    runs, sampled around every broadcast and all-gather (where packing makes parameters whole
    and chunks release them): the distinct storages the module's parameters point at, plus the
    output buffer of the collective (a parameter being gathered, a chunk being broadcast)."""
    params = list(module.parameters())

    def sample(extra: torch.Tensor) -> None:
        storages = {t.untyped_storage().data_ptr(): t for t in [extra, *(p.data for p in params)]}
        live = sum(t.untyped_storage().nbytes() for t in storages.values())
        peak[0] = max(peak[0], live)

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def collective(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            sample(tensor)
            result = original(tensor, *args, **kwargs)
            sample(tensor)
            return result

        return collective

    originals = {name: getattr(shardwise.comm, name) for name in ("broadcast", "all_gather")}
    for name, original in originals.items():
        setattr(shardwise.comm, name, counted(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(shardwise.comm, name, original)


def _layers() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def _wrap_peak(in_context: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    if in_context:
        with ZeroInitContext(CPU, TensorShardStrategy(), seed=0):
            module = _layers()
    else:
        torch.manual_seed(0)
        module = _layers()
    peak = [0]
    with _whole_bytes_peak(module, peak):
        model = zero_model_wrapper(
            module, 3, {"device": CPU, "placement_policy": "cuda", "chunk_size_numel": LAYER_NUMEL}
        )
    return {
        "peak": peak[0],
        "chunks": [c.numel for c in model.chunk_manager.chunks],
        "state": model.state_dict(only_rank_0=False),
        "gathers": model.comm_stats.calls(CommOp.ALL_GATHER),
    }


def test_wrapping_a_model_built_sliced_holds_about_one_chunk_whole() -> None:
    model_bytes = LAYERS * LAYER_BYTES
    # One chunk's parameters made whole, its buffer while it is broadcast, and rounding: far
    # below the whole model (8 chunks).
    cap = 3 * LAYER_BYTES
    sliced, plain = run_ranks(_wrap_peak, 2, True), run_ranks(_wrap_peak, 2, False)
    for got, reference in zip(sliced, plain, strict=True):
        assert got["peak"] <= cap, (got["peak"], cap, model_bytes)
        assert got["chunks"] == reference["chunks"] == [LAYER_NUMEL] * LAYERS
        # Each parameter was gathered once (and the state dict gathered nothing more).
        assert got["gathers"] == reference["gathers"] + 2 * LAYERS
        for key, value in reference["state"].items():
            assert torch.equal(got["state"][key], value), key
        # The same model built plainly is whole when it is wrapped: the measurement sees it.
        assert reference["peak"] >= model_bytes, (reference["peak"], model_bytes)


# ---- layout and training identical to a plain construction ---------------------------------

VOCAB, DIM, CHUNK_NUMEL = 50, 24, 1000


class _TiedNet(nn.Module):
    """Tied embedding and head (one parameter larger than a chunk), and a frozen weight whose
    trainable bias joins the chunk before it: that chunk is full only after the frozen chunk
    is, so chunks close out of id order."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(4))
        self.blocks[1].weight.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(idx)
        for block in self.blocks:
            hidden = torch.tanh(block(hidden))
        return nn.functional.cross_entropy(
            self.head(hidden).reshape(-1, VOCAB), targets.reshape(-1)
        )


POLICIES: dict[str, dict[str, Any]] = {
    "cuda": {"placement_policy": "cuda"},
    "cpu": {"placement_policy": "cpu"},
    "static_half_sharded": {"placement_policy": "static", "shard_param_frac": 0.5},
    "auto": {"placement_policy": "auto", "device_budget_bytes": 2**30},
}


def _train(in_context: bool, policy: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    if in_context:
        with ZeroInitContext(CPU, TensorShardStrategy(), seed=0):
            module = _TiedNet()
    else:
        torch.manual_seed(0)
        module = _TiedNet()
    config = {"device": CPU, "chunk_size_numel": CHUNK_NUMEL, **POLICIES[policy]}
    model = zero_model_wrapper(module, 3, config)
    layout = [
        (
            c.chunk_id,
            c.requires_grad,
            c.keep_gathered,
            c.capacity_numel,
            [t.name for t in c.tensors],
        )
        for c in model.chunk_manager.chunks
    ]
    placement = [(r["payload"], r["optim"]) for r in model.chunk_manager.report()]
    optimizer = zero_optim_wrapper(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        idx = torch.randint(VOCAB, (2 * world, 6), generator=generator)
        targets = torch.randint(VOCAB, (2 * world, 6), generator=generator)
        optimizer.zero_grad()
        loss = model(idx[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.detach().clone())
    return {
        "layout": layout,
        "placement": placement,
        "losses": losses,
        "state": model.state_dict(only_rank_0=False),
    }


def _sweep() -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    return {
        f"{policy}/{'sliced' if in_context else 'plain'}": _train(in_context, policy)
        for policy in POLICIES
        for in_context in (True, False)
    }


def test_chunks_placement_and_training_match_a_plain_construction() -> None:
    for results in run_ranks(_sweep, 2):
        for policy in POLICIES:
            got, reference = results[f"{policy}/sliced"], results[f"{policy}/plain"]
            assert got["layout"] == reference["layout"], policy
            assert got["placement"] == reference["placement"], policy
            assert all(
                torch.equal(a, b) for a, b in zip(got["losses"], reference["losses"], strict=True)
            ), policy
            for key, value in reference["state"].items():
                assert torch.equal(got["state"][key], value), (policy, key)
        layout = results["cuda/plain"]["layout"]
        # The tied weight is stored once, in a chunk of its own size; the frozen weight has its
        # own chunk and its bias went to the trainable one before; every chunk is sharded.
        assert [(trainable, capacity) for _, trainable, _, capacity, _ in layout] == [
            (True, VOCAB * DIM),
            (True, CHUNK_NUMEL),
            (False, CHUNK_NUMEL),
            (True, CHUNK_NUMEL),
            (True, CHUNK_NUMEL),
        ]
        assert layout[1][4] == ["blocks.0.weight", "blocks.0.bias", "blocks.1.bias"]
        assert not any(keep for _, _, keep, _, _ in layout)
        # shard_param_frac=0.5 keeps the last two of five chunks gathered.
        halves = results["static_half_sharded/sliced"]["layout"]
        assert [keep for _, _, keep, _, _ in halves] == [False, False, False, True, True]
