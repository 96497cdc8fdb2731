"""Models built on the meta device: each module materialised on its rank as it is packed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import run_ranks

CPU = torch.device("cpu")
VOCAB, WIDTH = 40, 32


class Net(nn.Module):
    """Modules whose reset_parameters define every value: an embedding tied to the head, linear
    layers, a layer norm and a batch norm (with running-statistics buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.norm = nn.LayerNorm(WIDTH)
        self.batch_norm = nn.BatchNorm1d(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        h = self.batch_norm(self.norm(h))
        return nn.functional.cross_entropy(self.head(h), tokens)


def _tokens(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (2 * 8,), generator=generator)
    return tokens.chunk(2)[dist.get_rank()]


def _build(meta: bool, stage: int, **config: Any) -> tuple[Any, Net]:
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = Net()
    else:
        model = Net()
    options: dict[str, Any] = {"device": CPU, **config}
    if stage == 3:
        options["chunk_size_numel"] = 1500  # several chunks
    return zero_model_wrapper(model, stage, options), model


def _meta_against_plain(stage: int) -> dict[str, Any]:
    results = {}
    for meta in (False, True):
        wrapped, model = _build(meta, stage)
        initial = wrapped.state_dict(only_rank_0=False)
        optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses = []
        for step in range(3):
            optimizer.zero_grad()
            loss = wrapped(_tokens(step))
            optimizer.backward(loss)
            optimizer.step()
            losses.append(float(loss.detach()))
        results[meta] = {
            "initial": initial,
            "losses": losses,
            "tied": model.head.weight is model.embed.weight,
            "meta_left": [n for n, t in model.state_dict().items() if t.is_meta],
        }
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_meta_model_equals_an_unsharded_construction_with_the_same_seed(stage: int) -> None:
    torch.manual_seed(0)
    expected = Net().state_dict()
    for result in run_ranks(_meta_against_plain, 2, stage):
        meta, plain = result[True], result[False]
        assert sorted(meta["initial"]) == sorted(expected)
        for name, value in expected.items():
            assert torch.equal(meta["initial"][name], value), name
            assert torch.equal(plain["initial"][name], value), name
        assert meta["losses"] == plain["losses"]
        assert meta["tied"] and not meta["meta_left"]


def _whole_model_never_materialised() -> list[int]:
    """At each module's initialisation, how many elements of the model are whole on this rank:
    materialised and not yet released into a sharded chunk."""
    whole_at_init: list[int] = []
    holder: dict[str, nn.Module] = {}

    def init(module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        params = holder["root"].parameters()
        whole_at_init.append(sum(p.data.numel() for p in params if not p.is_meta))

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net()
    holder["root"] = model
    zero_model_wrapper(model, 3, {"device": CPU, "chunk_size_numel": 1500, "param_init_fn": init})
    return whole_at_init


def test_stage_3_materialises_one_module_at_a_time_never_the_whole_model() -> None:
    total = sum(p.numel() for p in Net().parameters())
    whole = run_ranks(_whole_model_never_materialised, 2)[0]
    # Released parameters of sharded chunks hold no elements; the open chunk and the module
    # being initialised do. The largest moment stays well under the model.
    assert len(whole) == 7  # every module with tensors of its own, once (the tied head: none)
    assert max(whole) < total // 2, (whole, total)


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_a_module_without_an_initialiser_is_refused_with_the_fix() -> None:
    with torch.device("meta"):
        model = NoReset()
    with pytest.raises(ValueError, match="param_init_fn"):
        zero_model_wrapper(model, 2, {"device": CPU})


def test_param_init_fn_initialises_a_module_without_reset_parameters() -> None:
    with torch.device("meta"):
        model = NoReset()

    def init(module: nn.Module) -> None:
        if isinstance(module, NoReset):
            module.weight.fill_(0.5)

    wrapped = zero_model_wrapper(model, 2, {"device": CPU, "param_init_fn": init})
    assert torch.equal(wrapped.state_dict()["weight"], torch.full((4, 4), 0.5))
