"""Stage 3's chunks stepping during backward (`step_in_backward=True`, see [Note: the optimizer
steps during backward] in engine/backward_step.py) against the step after backward: bit for
bit, with the chunks really stepped before `step()` is called; and what it refuses.

The reference is the engine's own step after backward in the same process group, from the
same seed and batches: the issue's acceptance is "results stay bit-identical to the
unpipelined step". That step is held against plain torch loops by test_parity.py and
test_gemini.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, adamw, batch_slice, make_model

from shardwise import (
    Chunking,
    EngineConfig,
    MixedPrecision,
    Overlap,
    zero_model_wrapper,
    zero_optim_wrapper,
)
from shardwise.engine.wrap import wrap_model, wrap_optimizer
from shardwise.optim import HybridAdam
from shardwise.testing import run_ranks

CPU = torch.device("cpu")
STEPS = 3


def _wrapped(placement: str, branch: str = "always", **config: Any) -> tuple[Any, Any]:
    options: dict[str, Any] = {
        "device": CPU,
        "placement_policy": placement,
        "chunk_size_numel": CHUNK_NUMEL,
        **config,
    }
    if placement == "auto":  # a budget that holds about half the model's state
        options["device_budget_bytes"] = 200_000
    model = make_model(branch=branch)
    return zero_model_wrapper(model, 3, options), model


def _masters(optimizer: Any) -> dict[str, torch.Tensor]:
    return {name: view.detach().clone() for name, view in optimizer.shard_views.items()}


# 16-bit storage (the payloads in bf16 beside fp32 masters), compute in fp32 (see the brief on
# CPU matmuls).
BF16_STORAGE = MixedPrecision(param_dtype=torch.bfloat16, compute_dtype=torch.float32)


def _train(
    placement: str,
    step_in_backward: bool,
    optimizer_name: str = "adamw",
    branch: str = "always",
    bf16: bool = False,
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"mixed_precision": BF16_STORAGE} if bf16 else {}
    wrapped, model = _wrapped(placement, branch, **config)
    inner = (
        HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
        if optimizer_name == "hybrid_adam"
        else adamw(model.parameters())
    )
    optimizer = zero_optim_wrapper(wrapped, inner, step_in_backward=step_in_backward)
    losses, stepped_early, changed_in_backward = [], [], []
    for step in range(STEPS):
        idx, targets = batch_slice(step, 0, rank, world)
        loss = wrapped(idx, targets)
        before = _masters(optimizer)
        optimizer.backward(loss)
        after = _masters(optimizer)
        changed_in_backward.append(sum(not torch.equal(before[n], after[n]) for n in before))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
        stepped_early.append(optimizer.last_stepped_in_backward)
    return {
        "losses": losses,
        "state": wrapped.state_dict(only_rank_0=False),
        "optimizer": optimizer.state_dict()["optimizer"]["state"],
        "stepped_early": stepped_early,
        "changed_in_backward": changed_in_backward,
        "chunks": len(list(wrapped.chunk_manager.trainable_chunks())),
    }


def _against_the_step_after_backward(
    placement: str, optimizer_name: str, branch: str, bf16: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    after = _train(placement, False, optimizer_name, branch, bf16)
    during = _train(placement, True, optimizer_name, branch, bf16)
    return after, during


@pytest.mark.parametrize(
    ("placement", "optimizer_name", "branch", "bf16"),
    [
        ("cuda", "adamw", "always", False),
        ("cuda", "adamw", "always", True),
        ("cpu", "hybrid_adam", "always", True),
        ("auto", "adamw", "always", False),
        # A branch no rank runs: its chunk waits for the step's all-reduce to learn whether
        # some rank's gradient reached it, and its tensors are left out of the step.
        ("cpu", "adamw", "never", False),
    ],
)
def test_chunks_step_during_backward_bit_for_bit(
    placement: str, optimizer_name: str, branch: str, bf16: bool
) -> None:
    for after, during in run_ranks(
        _against_the_step_after_backward, 2, placement, optimizer_name, branch, bf16
    ):
        for old, new in zip(after["losses"], during["losses"], strict=True):
            assert torch.equal(old, new)
        assert after["state"].keys() == during["state"].keys()
        for name, value in after["state"].items():
            assert torch.equal(value, during["state"][name]), name
        for key, state in after["optimizer"].items():
            for name, value in state.items():
                assert torch.equal(
                    torch.as_tensor(value), torch.as_tensor(during["optimizer"][key][name])
                ), (key, name)
        # The reference steps nothing during backward; the run under test steps chunks there,
        # and their masters have moved before step() was called (the first step included).
        assert after["stepped_early"] == [0] * STEPS
        assert after["changed_in_backward"] == [0] * STEPS
        assert all(0 < n <= during["chunks"] for n in during["stepped_early"])
        assert all(n > 0 for n in during["changed_in_backward"])
        if branch == "never":  # the branch's chunk waits for the step's all-reduce
            assert all(n < during["chunks"] for n in during["stepped_early"])


def _accumulate(no_sync: bool) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped, model = _wrapped("cpu")
    optimizer = zero_optim_wrapper(wrapped, adamw(model.parameters()), step_in_backward=True)
    for micro in range(2):
        idx, targets = batch_slice(0, micro, rank, world)
        if no_sync and micro == 0:
            with wrapped.no_sync():
                optimizer.backward(wrapped(idx, targets) / 2)
        else:
            optimizer.backward(wrapped(idx, targets) / 2)
    optimizer.step()
    return [v.clone() for v in wrapped.state_dict(only_rank_0=False).values()]


def _accumulate_after_backward() -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped, model = _wrapped("cpu")
    optimizer = zero_optim_wrapper(wrapped, adamw(model.parameters()))
    for micro in range(2):
        idx, targets = batch_slice(0, micro, rank, world)
        optimizer.backward(wrapped(idx, targets) / 2)
    optimizer.step()
    return [v.clone() for v in wrapped.state_dict(only_rank_0=False).values()]


def test_accumulation_under_no_sync_steps_the_sum() -> None:
    stepped = run_ranks(_accumulate, 2, True)
    reference = run_ranks(_accumulate_after_backward, 2)
    for during, after in zip(stepped, reference, strict=True):
        for new, old in zip(during, after, strict=True):
            # The sum of two micro-batches reduced once against twice: fp32 rounding apart.
            torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-6)


def test_accumulation_without_no_sync_is_refused() -> None:
    with pytest.raises(Exception, match="no_sync"):
        run_ranks(_accumulate, 2, False)


def _lr_changed_between_backward_and_step() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped, model = _wrapped("cpu")
    optimizer = zero_optim_wrapper(wrapped, adamw(model.parameters()), step_in_backward=True)
    idx, targets = batch_slice(0, 0, rank, world)
    optimizer.backward(wrapped(idx, targets))
    for group in optimizer.param_groups:
        group["lr"] = 1e-3
    optimizer.step()


def test_hyperparameters_changed_between_backward_and_step_are_refused() -> None:
    with pytest.raises(Exception, match="hyperparameters changed between backward and step"):
        run_ranks(_lr_changed_between_backward_and_step, 2)


def _refusals() -> list[str]:
    said = []
    for stage, kwargs, config in (
        (2, {}, {}),
        (3, {"max_norm": 1.0}, {}),
        # Every chunk kept gathered: nothing could step during backward.
        (3, {}, {"placement_policy": "static", "shard_param_frac": 0.0}),
        (
            3,
            {},
            {
                "mixed_precision": MixedPrecision(
                    param_dtype=torch.float16, compute_dtype=torch.float32
                )
            },
        ),
    ):
        model = make_model()
        options: dict[str, Any] = {"device": CPU, **config}
        if stage == 3:
            options["chunk_size_numel"] = CHUNK_NUMEL
        wrapped = zero_model_wrapper(model, stage, options)
        with pytest.raises(ValueError) as error:
            zero_optim_wrapper(wrapped, adamw(model.parameters()), step_in_backward=True, **kwargs)
        said.append(str(error.value))
    return said


def test_what_needs_the_whole_gradient_is_refused() -> None:
    (said,) = run_ranks(_refusals, 1)
    assert "at stage 2" in said[0]
    assert "cannot clip (max_norm=1.0)" in said[1]
    assert "no chunk can step during backward" in said[2]
    assert "fp16 loss scaling" in said[3]


def _from_the_engine_config() -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    config = EngineConfig(
        stage=3,
        device=CPU,
        chunking=Chunking(size_numel=CHUNK_NUMEL),
        overlap=Overlap(step_in_backward=True),
    )
    wrapped = wrap_model(model, config)
    optimizer = wrap_optimizer(wrapped, adamw(model.parameters()))
    idx, targets = batch_slice(0, 0, rank, world)
    optimizer.backward(wrapped(idx, targets))
    optimizer.step()
    return optimizer.last_stepped_in_backward


def test_the_engine_config_turns_it_on_for_every_front_door() -> None:
    # The adapters (Lightning, the Trainer) take an EngineConfig (engine_config=): its
    # overlap.step_in_backward is the optimizer's default.
    assert all(n > 0 for n in run_ranks(_from_the_engine_config, 2))
    with pytest.raises(ValueError, match="step_in_backward applies to stage 3"):
        EngineConfig(stage=2, device=CPU, overlap=Overlap(step_in_backward=True))


def _llama_with_checkpointing(reentrant: bool, early: bool) -> dict[str, Any]:
    """A Hugging Face Llama under activation checkpointing, as users run large models."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            use_cache=False,
        )
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    wrapped = zero_model_wrapper(
        model, 3, {"device": CPU, "chunk_size_numel": 20_000, "placement_policy": "cpu"}
    )
    optimizer = zero_optim_wrapper(wrapped, adamw(model.parameters()), step_in_backward=early)
    losses, stepped = [], []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        ids = torch.randint(0, 128, (2, 16), generator=generator)
        loss = wrapped(input_ids=ids, labels=ids).loss
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
        stepped.append(optimizer.last_stepped_in_backward)
    return {"losses": losses, "stepped": stepped, "state": wrapped.state_dict(only_rank_0=False)}


def _checkpointed_pair(reentrant: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    return _llama_with_checkpointing(reentrant, False), _llama_with_checkpointing(reentrant, True)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_steps_during_the_outer_backward(reentrant: bool) -> None:
    # Reentrant checkpointing runs a backward inside the backward for each block: chunks
    # reduced there step at the outer pass's next hook, as any other.
    for after, during in run_ranks(_checkpointed_pair, 2, reentrant):
        for old, new in zip(after["losses"], during["losses"], strict=True):
            assert torch.equal(old, new)
        for name, value in after["state"].items():
            assert torch.equal(value, during["state"][name]), name
        assert after["stepped"] == [0] * STEPS
        assert all(n > 0 for n in during["stepped"]), during["stepped"]


def _skipping_a_batch_after_backward() -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped, model = _wrapped("cpu")
    optimizer = zero_optim_wrapper(wrapped, adamw(model.parameters()), step_in_backward=True)
    idx, targets = batch_slice(0, 0, rank, world)
    optimizer.backward(wrapped(idx, targets))
    for group in optimizer.param_groups:  # a schedule moving on without this batch's step
        group["lr"] = 1e-3
    with pytest.warns(RuntimeWarning, match="zero_grad\\(\\) without step\\(\\)") as said:
        optimizer.zero_grad()
    idx, targets = batch_slice(1, 0, rank, world)
    optimizer.backward(wrapped(idx, targets))
    optimizer.step()  # the chunks stepped before zero_grad() are forgotten, not refused
    return [str(warning.message) for warning in said]


def test_zero_grad_without_step_says_the_chunks_that_stepped_keep_their_step() -> None:
    for said in run_ranks(_skipping_a_batch_after_backward, 2):
        assert any("keep that step" in message for message in said), said
