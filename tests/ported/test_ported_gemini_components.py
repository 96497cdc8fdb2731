"""Ported from hpcaitech/ColossalAI (0.2.x): tests/test_gemini/update/test_optim.py
(`exam_tiny_example`) over the models of its `EXAMPLE_MODELS` list and two more of
tests/components_to_test/: `nested_model` (a weight handed to another module's forward),
`hanging_param_model` / `no_leaf_module` (a parameter of a module that also has children, used
by `F.linear` in its own forward), `repeated_computed_layers` (layers called twice per pass, from
a plain Python list), `inline_op_model` (in-place ops between layers), `simple_net`, and
transformers' `bert` and `albert` (ALBERT runs one shared layer for every layer), each built as
the registry builds it.

Kept: each model wrapped in ZeroDDP (stage 3) under each placement policy beside the same model
in torch DDP, both stepped by Adam (lr 1e-3), each rank with its own batches seeded by rank x 3
+ 128; at each of 3 steps the two losses agree, and after each step every parameter of the
ZeRO model (`state_dict(only_rank_0=False)`) agrees with DDP's. Nothing is marked: the engine
finds where each parameter is used. The same models run at stages 1 and 2 too (buckets of 64
elements), eager and compiled.

Changes: CPU and gloo instead of CUDA and NCCL, 2 ranks instead of 1 and 4; chunks of 64
elements rather than the original's searched size, which packed each of these models into one
chunk ("these models are too small", its comment says): with one chunk every parameter is
gathered for every module, and a use outside the owning module could not go wrong; split over
many chunks, it can. Each model also runs compiled as a whole (`torch.compile` of the wrapped
model against `torch.compile` of DDP, aot_eager backend, see tests/test_compile.py) under the
"cuda" and "cpu" policies.

Deliberate differences: fp32 throughout, where the original ran fp16 apex O2 against fp16 ZeRO
within rtol 1e-3, atol 4e-3: here two ranks are held bit-exact. DDP with
`find_unused_parameters=True`. torch's Adam on both sides (the original stepped ZeRO with
HybridAdam). "const" is our "static" policy with half of the shards and optimizer sides in host
memory; "auto" runs under a device budget of the unsharded model state's bytes (as
tests/ported/test_ported_gemini_optim.py), not the whole device.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import run_ranks

STEPS = 3
CHUNK = 64
PLACEMENTS: dict[str, dict[str, Any]] = {
    "cuda": {"placement_policy": "cuda"},
    "cpu": {"placement_policy": "cpu"},
    "auto": {"placement_policy": "auto"},  # budget: the unsharded model state, set per model
    "static": {"placement_policy": "static", "offload_param_frac": 0.5, "offload_optim_frac": 0.5},
}


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
        x = self.fc1(x)
        x = self.sub_fc(x, self.fc1.weight)
        x = self.fc1(x)
        return self.fc2(x)


class HangingParamModule(nn.Module):
    """A parameter of a module that has children too (no_leaf_module is the same model)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj1 = nn.Linear(4, 8)
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.proj2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj2(F.linear(self.proj1(x), self.weight))


class NetWithRepeatedlyComputedLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 5)
        self.fc2 = nn.Linear(5, 5)
        self.fc3 = nn.Linear(5, 2)
        self.layers = [self.fc1, self.fc2, self.fc1, self.fc2, self.fc3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class InlineOpModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj1 = nn.Linear(4, 8)
        self.proj2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj1(x)
        x.add_(10)
        x = torch.relu_(self.proj2(x))
        return self.proj2(x)


class SimpleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 4)
        self.proj1 = nn.Linear(4, 8)
        self.ln1 = nn.LayerNorm(8)
        self.proj2 = nn.Linear(8, 4)
        self.ln2 = nn.LayerNorm(4)
        self.classifier = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(self.proj1(self.embed(x)))
        return self.classifier(self.ln2(self.proj2(x)))


class _Classifier(nn.Module):
    """The registry's adaptor: `forward(input_ids, labels)` returns the model's loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.model(input_ids=input_ids, labels=labels)[0]
        return loss


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        hidden_size=8, intermediate_size=32, num_attention_heads=4,
        max_position_embeddings=12, num_hidden_layers=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return _Classifier(BertForSequenceClassification(config))


def _albert() -> nn.Module:
    from transformers import AlbertConfig, AlbertForSequenceClassification

    config = AlbertConfig(
        vocab_size=32, hidden_size=8, intermediate_size=32, num_attention_heads=4,
        max_position_embeddings=12, num_hidden_layers=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return _Classifier(AlbertForSequenceClassification(config))


def _dense(width: int) -> Callable[[torch.Generator], Any]:
    def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.rand(16, width, generator=generator),
            torch.randint(0, 2, (16,), generator=generator),
        )

    return batch


def _tokens(high: int, shape: tuple[int, ...]) -> Callable[[torch.Generator], Any]:
    def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.randint(0, high, shape, generator=generator),
            torch.randint(0, 2, shape[:1], generator=generator),
        )

    return batch


# name -> (builder, batch of (input, label), whether the model returns its own loss)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Any], bool]] = {
    "nested_model": (NestedNet, _dense(5), False),
    "hanging_param_model": (HangingParamModule, _dense(4), False),
    "repeated_computed_layers": (NetWithRepeatedlyComputedLayers, _dense(5), False),
    "inline_op_model": (InlineOpModule, _dense(4), False),
    "simple_net": (SimpleNet, _tokens(20, (16,)), False),
    "bert": (_bert, _tokens(1000, (2, 12)), True),
    "albert": (_albert, _tokens(32, (2, 12)), True),
}
HF_MODELS = ("bert", "albert")


def _loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor], own_loss: bool) -> torch.Tensor:
    data, label = batch
    if own_loss:
        return model(data, label)  # type: ignore[no-any-return]
    return F.cross_entropy(model(data), label)


def _exam_tiny_example(name: str, stage: int, placement: str, compiled: bool) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    builder, make_batch, own_loss = MODELS[name]
    torch.manual_seed(2008)
    torch_model = builder().eval()  # as the original: no dropout (ALBERT's classifier has it)
    model = copy.deepcopy(torch_model)
    ddp = DistributedDataParallel(torch_model, find_unused_parameters=True)
    torch_step = torch.compile(ddp, backend="aot_eager") if compiled else ddp
    torch_optim = torch.optim.Adam(ddp.parameters(), lr=1e-3)

    options: dict[str, Any] = {"device": torch.device("cpu")}
    if stage == 3:
        options.update(chunk_size_numel=CHUNK, **PLACEMENTS[placement])
    if placement == "auto":
        options["device_budget_bytes"] = sum(p.numel() for p in model.parameters()) * 16
    zero = zero_model_wrapper(model, stage, options)
    zero_optim = zero_optim_wrapper(
        zero,
        torch.optim.Adam(model.parameters(), lr=1e-3),
        optim_config={"reduce_bucket_size": CHUNK} if stage < 3 else None,
    )
    zero_step = torch.compile(zero, backend="aot_eager") if compiled else zero

    generator = torch.Generator().manual_seed(dist.get_rank() * 3 + 128)
    losses, problems = [], []
    for step in range(STEPS):
        if step == 2:
            counters.clear()
        batch = make_batch(generator)
        zero_optim.zero_grad()
        torch_optim.zero_grad()
        torch_loss = _loss(torch_step, batch, own_loss)
        torch_loss.backward()
        loss = _loss(zero_step, batch, own_loss)
        zero_optim.backward(loss)
        losses.append((float(torch_loss), float(loss)))
        torch_optim.step()
        zero_optim.step()
        zero_dict = zero.state_dict(only_rank_0=False)
        for key, value in torch_model.state_dict().items():
            if not torch.equal(zero_dict[key], value):
                problems.append(f"step {step}: {key} differs")
    late = counters["stats"].get("unique_graphs", 0) + sum(counters["recompiles"].values())
    return {"losses": losses, "problems": problems, "compiled_late": late}


def _all(cases: list[tuple[str, int, str, bool]]) -> list[dict[str, Any]]:
    return [_exam_tiny_example(*case) for case in cases]


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_examples_step_as_ddp_does_with_nothing_marked(name: str) -> None:
    cases = [(name, 3, placement, False) for placement in PLACEMENTS]
    cases += [(name, stage, "", False) for stage in (1, 2)]
    # Compiled: every stage and two placements for the small models; the transformers ones
    # (most of this test's time goes to compiling them) once, at stage 3, which compiles
    # through the engine's gather hooks: the small models cover the rest of the grid.
    if name in HF_MODELS:
        cases += [(name, 3, "cuda", True)]
    else:
        cases += [(name, 3, placement, True) for placement in ("cuda", "cpu")]
        cases += [(name, stage, "", True) for stage in (1, 2)]
    for per_rank in run_ranks(_all, 2, cases, timeout_s=600):
        for case, result in zip(cases, per_rank, strict=True):
            assert all(theirs == ours for theirs, ours in result["losses"]), (case, result)
            assert result["problems"] == [], (case, result["problems"][:5])
            assert result["compiled_late"] == 0, (case, result)
