"""Ported from hpcaitech/ColossalAI:
- tests/test_zero/test_state_dict.py (0.1.x): a model built in a ZeroInitContext and wrapped
  in ShardedModelV2, with either shard strategy, on 1 and 2 ranks: `state_dict()` on every rank
  equals the unsharded model's state dict (torch.equal, every key).
- tests/test_ddp/test_ddp_state_dict.py (0.1.x-0.2.x): a nested model wrapped in ColoDDP and in
  ZeroDDP (with and without a searched chunk size, sharded or not) loads a plain model's state
  dict and gives it back: the same keys in the same order, values allclose (1e-3).

Changes: the models are ours (BranchyGPT for the first, a nested net written after the
original's for the second) and run on the CPU, 2 ranks (and 1 for the first) forked in one group
per world size.

Deliberate differences:
- The original's ZeroDDP without "distributed storage" (`enable_distributed_storage=False`,
  every rank keeping whole chunks) is GeminiDDP's `strict_ddp_mode=True` here (every chunk
  kept gathered on every rank), and the distributed ones GeminiDDP (ZeroDDP) as it is.
- ZeroDDP.state_dict() keeps the original's default `only_rank_0=True` (ColossalAI's too), under
  which ranks other than 0 get an empty dict: the original's zip() then compared nothing there.
  The port checks that rank 0's dict matches and that the others' is empty, and compares the
  `only_rank_0=False` dict on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import BranchyGPT, make_model
from torch import nn

from shardwise import (
    BucketTensorShardStrategy,
    ChunkManager,
    ColoDDP,
    GeminiManager,
    ShardedModelV2,
    TensorShardStrategy,
    ZeroDDP,
    ZeroInitContext,
)
from shardwise.chunk.search import search_chunk_size
from shardwise.testing import run_ranks

CPU = torch.device("cpu")


def _zero_state_dict() -> list[bool]:
    results = []
    for strategy_class in (TensorShardStrategy, BucketTensorShardStrategy):
        strategy = strategy_class()
        with ZeroInitContext(CPU, strategy, seed=0):
            zero_model = BranchyGPT()
        zero_model = ShardedModelV2(zero_model, strategy)
        model = make_model()  # the same seed, built plainly
        zero_state_dict = zero_model.state_dict()
        for key, val in model.state_dict().items():
            results.append(torch.equal(val, zero_state_dict[key].to(val.device)))
    return results


def test_zero_state_dict() -> None:
    for world_size in (1, 2):
        for results in run_ranks(_zero_state_dict, world_size):
            assert results and all(results)


class SubNet(nn.Module):
    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, self.bias)


class NestedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 5)
        self.sub_fc = SubNet(5)
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(self.sub_fc(self.fc1(x), self.fc1.weight)))


def check_state_dict_equal(state_dict: dict[str, Any], other_state_dict: dict[str, Any]) -> bool:
    ok = len(state_dict) == len(other_state_dict)
    for (k1, t1), (k2, t2) in zip(state_dict.items(), other_state_dict.items(), strict=False):
        ok = ok and k1 == k2 and torch.allclose(t1, t2, atol=1e-3, rtol=1e-3)
    return ok


def _init_ddpv2(module: nn.Module, use_chunk: bool, use_zero: bool) -> nn.Module:
    numels = [[p.numel() for p in module.parameters()], []]
    chunk_size = (
        search_chunk_size(numels, world_size=dist.get_world_size(), search_range_numel=64,
                          n_grids=4, min_chunk_size_numel=1).chunk_size_numel
        if use_chunk
        else sum(numels[0])
    )  # fmt: skip
    chunk_manager = ChunkManager(chunk_size_numel=chunk_size, device=CPU)
    # Without distributed storage: every chunk kept whole on every rank (strict_ddp_mode).
    model = ZeroDDP(module, GeminiManager("cuda", chunk_manager), strict_ddp_mode=not use_zero)
    assert all(c.keep_gathered != use_zero for c in model.chunk_manager.chunks)
    return model


def _ddp_state_dict() -> dict[str, bool]:
    results = {}
    inits = {"ColoDDP": ColoDDP}
    for use_chunk in (False, True):
        for use_zero in (False, True):
            inits[f"ZeroDDP chunk={use_chunk} zero={use_zero}"] = (
                lambda m, c=use_chunk, z=use_zero: _init_ddpv2(m, c, z)
            )
    for name, init in inits.items():
        torch.manual_seed(0)
        torch_model = NestedNet()
        torch.manual_seed(1)  # another initialisation, replaced by the load
        model = init(NestedNet())
        torch_state_dict = torch_model.state_dict()
        model.load_state_dict(torch_state_dict)
        state_dict = model.state_dict()
        if not isinstance(model, ColoDDP) and dist.get_rank() != 0:
            results[f"{name}: rank-0-only default"] = state_dict == {}
        else:
            results[f"{name}: default"] = check_state_dict_equal(torch_state_dict, state_dict)
        if not isinstance(model, ColoDDP):
            full = model.state_dict(only_rank_0=False)
            results[f"{name}: whole on every rank"] = check_state_dict_equal(torch_state_dict, full)
    return results


def test_ddp_state_dict() -> None:
    for results in run_ranks(_ddp_state_dict, 2):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, failed
        assert len(results) == 9
