"""torch.compile at every stage: the compiled sharded run against the same compiled plain one.

Each case trains a GPT two ways on 2 ranks, fp32, same seed and global batch: torch DDP
(`find_unused_parameters=True`) and shardwise, each compiled the same way:
  blocks_before  every block `torch.compile`d before wrapping (torchtitan's way)
  blocks_after   every block `block.compile()`d in place after wrapping
  whole_before   the whole model `torch.compile`d, then wrapped
  whole_after    the wrapped model `torch.compile`d (DDP's side: the DDP module compiled)
The backend is aot_eager: dynamo's capture, guards and graph breaks and AOTAutograd's joint
graphs run as they do under inductor, without code generation (seconds, not minutes, per case
here); its kernels are eager's, so the two sides must agree bit for bit however their graphs
are split. After the first two steps (the first compiled call of a model compiled as a whole
runs eagerly, see [Note: a model compiled as a whole]) no step may compile anything again.
tests/test_compile_inductor.py runs inductor itself on a few cases.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import CONFIG, batch_slice
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from shardwise import ColoDDP, zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import GPT, run_ranks

STEPS = 4
BACKEND = "aot_eager"


class CheckpointedGPT(GPT):
    """The GPT with each block under non-reentrant activation checkpointing (the kind
    torch.compile traces), its forward re-run in backward."""

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


MODELS = {"gpt": GPT, "checkpointed": CheckpointedGPT}


def compile_blocks(model: GPT, how: str, backend: str) -> GPT:
    if how == "blocks_before":
        for index, block in enumerate(model.blocks):
            model.blocks[index] = torch.compile(block, backend=backend)
    if how == "blocks_after":
        for block in model.blocks:
            block.compile(backend=backend)
    return model


def compiled_pair(
    engine: str, placement: str, how: str, backend: str = BACKEND, model_name: str = "gpt"
) -> dict[str, Any]:
    """Train DDP and `engine` ("zero1", "zero2", "zero3", "colo") compiled as `how` says;
    their losses, the largest parameter difference, and what dynamo compiled after step 2."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = MODELS[model_name](CONFIG)
    ddp = DistributedDataParallel(plain, find_unused_parameters=True)
    compile_blocks(plain, how, backend)
    plain_step = torch.compile(ddp, backend=backend) if how.startswith("whole") else ddp
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)

    torch.manual_seed(0)
    model: Any = MODELS[model_name](CONFIG)
    if how == "blocks_before":
        compile_blocks(model, how, backend)
    if how == "whole_before":
        model = torch.compile(model, backend=backend)
    if engine == "colo":
        wrapped: Any = ColoDDP(model)
        optimizer: Any = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    else:
        options: dict[str, Any] = {"device": torch.device("cpu")}
        if engine == "zero3":
            options.update(chunk_size_numel=3001, placement_policy=placement)
            if placement == "auto":
                options["device_budget_bytes"] = 150_000  # below the model state: moves
        wrapped = zero_model_wrapper(model, int(engine[-1]), options)
        optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    if how == "blocks_after":
        compile_blocks(model, how, backend)
    step = torch.compile(wrapped, backend=backend) if how == "whole_after" else wrapped

    losses = []
    for index in range(STEPS):
        if index == 2:
            counters.clear()
        idx, targets = batch_slice(index, 0, rank, world)
        plain_optimizer.zero_grad()
        plain_loss = plain_step(idx, targets)[1]
        plain_loss.backward()
        plain_optimizer.step()
        optimizer.zero_grad()
        loss = step(idx, targets)[1]
        if engine == "colo":
            loss.backward()
        else:
            optimizer.backward(loss)
        optimizer.step()
        losses.append((float(plain_loss), float(loss)))
    late = {
        "graphs": counters["stats"].get("unique_graphs", 0),
        "recompiles": sum(counters["recompiles"].values()),
    }
    ours = {k.replace("_orig_mod.", ""): v for k, v in _state(wrapped, engine).items()}
    theirs = {k.replace("_orig_mod.", ""): v for k, v in plain.state_dict().items()}
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    diff = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    return {"losses": losses, "diff": diff, "late": late}


def _state(wrapped: Any, engine: str) -> dict[str, torch.Tensor]:
    if engine == "colo":
        return {k: v.detach() for k, v in wrapped.state_dict().items()}
    return dict(wrapped.state_dict(only_rank_0=False))


def _cases(cases: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [compiled_pair(*case) for case in cases]


def _check(cases: list[tuple[Any, ...]]) -> None:
    for per_rank in run_ranks(_cases, 2, cases, timeout_s=600):
        for case, result in zip(cases, per_rank, strict=True):
            assert all(plain == ours for plain, ours in result["losses"]), (case, result)
            assert result["diff"] == 0.0, (case, result)
            assert result["late"] == {"graphs": 0, "recompiles": 0}, (case, result)


@pytest.mark.parametrize("how", ["blocks_before", "blocks_after", "whole_before", "whole_after"])
def test_stage_3_compiled_matches_compiled_ddp(how: str) -> None:
    _check([("zero3", "cuda", how)])


@pytest.mark.parametrize("placement", ["cpu", "auto"])
def test_stage_3_compiled_under_host_placements(placement: str) -> None:
    _check([("zero3", placement, "blocks_before"), ("zero3", placement, "whole_after")])


@pytest.mark.parametrize("engine", ["zero1", "zero2", "colo"])
def test_stages_0_to_2_compiled_match_compiled_ddp(engine: str) -> None:
    _check([(engine, "", "blocks_after"), (engine, "", "whole_after")])


def test_activation_checkpointing_compiled_matches_compiled_ddp() -> None:
    _check(
        [
            ("zero3", "cuda", how, BACKEND, "checkpointed")
            for how in ("blocks_before", "whole_after")
        ]
        + [("zero2", "", "whole_after", BACKEND, "checkpointed")]
    )


def _experts_compiled(how: str) -> dict[str, Any]:
    from test_moe_stage3 import MoEModel, _batch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = MoEModel()
    ddp = DistributedDataParallel(plain, find_unused_parameters=True)
    plain_step = torch.compile(ddp, backend=BACKEND) if how == "whole_after" else ddp
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model = MoEModel()
    if how == "moes_before":  # each expert block compiled on its own: a unit, as it is anyway
        for index, moe in enumerate(model.moes):
            model.moes[index] = torch.compile(moe, backend=BACKEND)
        for index, moe in enumerate(plain.moes):
            plain.moes[index] = torch.compile(moe, backend=BACKEND)
    options = {"device": torch.device("cpu"), "chunk_size_numel": 200}
    wrapped = zero_model_wrapper(model, 3, options)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    step = torch.compile(wrapped, backend=BACKEND) if how == "whole_after" else wrapped
    losses = []
    for index in range(5):
        if index == 3:
            counters.clear()
        x, target = _batch(index, rank, world)
        plain_optimizer.zero_grad()
        plain_loss = (plain_step(x) - target).pow(2).mean()
        plain_loss.backward()
        plain_optimizer.step()
        optimizer.zero_grad()
        loss = (step(x) - target).pow(2).mean()
        optimizer.backward(loss)
        optimizer.step()
        losses.append((float(plain_loss), float(loss)))
    final = wrapped.state_dict(only_rank_0=False)
    theirs = {k.replace("_orig_mod.", ""): v for k, v in plain.state_dict().items()}
    ours = {k.replace("_orig_mod.", ""): v for k, v in final.items()}
    diff = max((ours[k] - v).abs().max().item() for k, v in theirs.items())
    return {"losses": losses, "diff": diff, "recompiles": sum(counters["recompiles"].values())}


@pytest.mark.parametrize("how", ["moes_before", "whole_after"])
def test_experts_routed_apart_compiled_match_compiled_ddp(how: str) -> None:
    for result in run_ranks(_experts_compiled, 2, how, timeout_s=600):
        assert all(plain == ours for plain, ours in result["losses"]), result
        assert result["diff"] == 0.0, result
        assert result["recompiles"] == 0, result  # after the first three steps


def _handed_into_a_compiled_block() -> dict[str, Any]:
    """ColossalAI's nested_model with its SubNet compiled on its own: the root hands
    `fc1.weight` into the compiled region, which the first (eager) pass sees and learns."""
    from ported.test_ported_gemini_components import NestedNet

    torch._dynamo.reset()
    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = NestedNet()
    plain.sub_fc = torch.compile(plain.sub_fc, backend=BACKEND)
    ddp = DistributedDataParallel(plain, find_unused_parameters=True)
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model = NestedNet()
    model.sub_fc = torch.compile(model.sub_fc, backend=BACKEND)
    wrapped = zero_model_wrapper(model, 3, {"device": torch.device("cpu"), "chunk_size_numel": 8})
    optimizer = zero_optim_wrapper(wrapped, torch.optim.Adam(model.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 5, generator=generator)
        plain_optimizer.zero_grad()
        plain_loss = ddp(x).square().mean()
        plain_loss.backward()
        plain_optimizer.step()
        optimizer.zero_grad()
        loss = wrapped(x).square().mean()
        optimizer.backward(loss)
        optimizer.step()
        losses.append((float(plain_loss), float(loss)))
    final = {
        k.replace("_orig_mod.", ""): v for k, v in wrapped.state_dict(only_rank_0=False).items()
    }
    theirs = {k.replace("_orig_mod.", ""): v for k, v in plain.state_dict().items()}
    units = [unit.name for unit in wrapped.scheduler.gather_units] if wrapped.scheduler else []
    diff = max((final[k] - v).abs().max().item() for k, v in theirs.items())
    return {"losses": losses, "diff": diff, "units": units}


def test_a_weight_handed_into_a_compiled_block_is_learned() -> None:
    for result in run_ranks(_handed_into_a_compiled_block, 2, timeout_s=300):
        assert all(plain == ours for plain, ours in result["losses"]), result
        assert result["diff"] == 0.0, result
        # fc1.weight is governed by the model itself now, fc1.bias still by fc1.
        assert result["units"] == ["", "fc1", "sub_fc", "fc2"], result


def _late_hand_off() -> str:
    """The weight is handed to the compiled SubNet only from the second forward on."""
    from ported.test_ported_gemini_components import NestedNet

    class LateHandOff(NestedNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls = getattr(self, "calls", 0) + 1
            x = self.fc1(x)
            weight = self.fc1.weight if self.calls > 1 else torch.eye(5)
            return self.fc2(self.sub_fc(x, weight))

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LateHandOff()
    model.sub_fc = torch.compile(model.sub_fc, backend=BACKEND)
    wrapped = zero_model_wrapper(model, 3, {"device": torch.device("cpu"), "chunk_size_numel": 8})
    optimizer = zero_optim_wrapper(wrapped, torch.optim.Adam(model.parameters(), lr=1e-2))
    try:
        for _ in range(2):
            optimizer.zero_grad()
            optimizer.backward(wrapped(torch.randn(4, 5)).square().mean())
            optimizer.step()
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_weight_handed_late_into_a_compiled_block_is_refused_naming_it() -> None:
    for message in run_ranks(_late_hand_off, 2, timeout_s=300):
        assert "fc1.weight (shape (5, 5)) is handed to the compiled module 'sub_fc'" in message
        assert "gather_units" in message
