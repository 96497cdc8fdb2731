"""Budgets a DeviceBudgetExceeded names pass: "auto" and "cpu" placement under a device budget
below the step's working set (see [Note: the working set and the budget] in
shardwise/gemini/working_set.py).

Two models on 2 ranks, fp32: transformers' GPT-2 (tiny config) with peft LoRA adapters on its
attention (frozen base weights), under "auto"; and the tests' GPT (every weight trained), under
"cpu". For each, budgets below the working set, with the chunk size searched and with one set:
- every rank raises alike (no rank left in a collective), after the first backward;
- rerun with the budget the error names, three full steps (forward, backward, optimizer step)
  pass, and train to the same bits as "cuda" placement (fp32: the placement moves bytes and
  changes no arithmetic);
- where the error names a chunk size, rerun with it within the original budget passes too,
  and its device peak stays within that budget;
- the LoRA model trains at a budget equal to the model state a rank keeps with "cuda"
  placement (it failed there before: frozen chunks stayed gathered until backward ended, and
  the chunk search grew chunks with the budget), and where a set chunk size makes the working
  set exceed that state, the error says so.
"""

from __future__ import annotations

import re
from typing import Any

import peft
import pytest
import torch
import torch.distributed as dist
from helpers import batch_slice, make_model
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.gemini import DeviceBudgetExceeded
from shardwise.testing import run_ranks

STEPS = 3
VOCAB = 128


def _lora_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"])
    return peft.get_peft_model(GPT2LMHeadModel(config), lora)


def _train(kind: str, policy: str, budget: int | None, chunk: int | None) -> dict[str, Any]:
    """Three steps; the losses, the final state and the device peak, or the error's text."""
    config: dict[str, Any] = {"device": torch.device("cpu"), "placement_policy": policy}
    if budget is not None:
        config["device_budget_bytes"] = budget
    if chunk is not None:
        config["chunk_size_numel"] = chunk
    model = _lora_gpt2() if kind == "lora" else make_model()
    wrapped = zero_model_wrapper(model, 3, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(trainable, lr=1e-2))
    gemini = wrapped.gemini_manager
    assert gemini is not None
    losses = []
    try:
        for step in range(STEPS):
            optimizer.zero_grad()
            if kind == "lora":
                generator = torch.Generator().manual_seed(10 * step + dist.get_rank())
                ids = torch.randint(0, VOCAB, (2, 16), generator=generator)
                loss = wrapped(input_ids=ids, labels=ids).loss
            else:
                loss = wrapped(*batch_slice(step, 0, dist.get_rank(), 2))
            optimizer.backward(loss)
            optimizer.step()
            losses.append(float(loss))
    except DeviceBudgetExceeded as error:
        return {"error": str(error), "steps": len(losses)}
    return {
        "losses": losses,
        "state": wrapped.state_dict(only_rank_0=False),
        "peak": gemini.peak_model_device_bytes,
        "model_state": sum(gemini.memory_by_pool().values()),
        "chunk": wrapped.chunk_manager.chunk_size_numel,
    }


def _named(message: str, pattern: str) -> int | None:
    found = re.search(pattern, message)
    return int(found.group(1)) if found else None


def _budget_cases() -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    cases = [
        # (model, placement, budget, chunk size set)
        ("lora", "auto", 2_000, None),
        ("lora", "auto", 45_000, None),
        ("lora", "auto", 55_000, 16_384),
        ("plain", "cpu", 40_000, None),
        ("plain", "cpu", 80_000, 16_384),
    ]
    for kind in ("lora", "plain"):
        out[f"{kind}/cuda"] = _train(kind, "cuda", None, None)
    for kind, policy, budget, chunk in cases:
        first = _train(kind, policy, budget, chunk)
        case: dict[str, Any] = {"first": first}
        message = first.get("error", "")
        named_budget = _named(message, r"device_budget_bytes=(\d+) passes the whole step")
        named_chunk = _named(message, r"within this budget, chunk_size_numel=(\d+)")
        if named_budget is not None:
            case["named_budget"] = named_budget
            case["with_budget"] = _train(kind, policy, named_budget, chunk)
            case["cuda_same_chunks"] = _train(kind, "cuda", None, chunk)
        if named_chunk is not None:
            case["named_chunk"] = named_chunk
            case["with_chunk"] = _train(kind, policy, budget, named_chunk)
        out[f"{kind}/{policy}/{budget}/{chunk}"] = case
    # The LoRA model at a budget of the model state "cuda" placement keeps on a rank.
    state = out["lora/cuda"]["model_state"]
    out["lora/at_model_state"] = _train("lora", "auto", state, None)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_budget_cases, 2, timeout_s=300)


def _assert_same_training(run: dict[str, Any], reference: dict[str, Any]) -> None:
    assert run["losses"] == reference["losses"]
    assert run["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        assert torch.equal(run["state"][key], value), key


def test_a_budget_the_error_names_passes_the_whole_step(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        for name, case in out.items():
            if "/cuda" in name or name == "lora/at_model_state":
                continue
            # Raised on every rank, at the end of the first backward (before any step).
            assert case["first"].get("steps") == 0, (rank, name, case["first"])
            assert case["named_budget"] == ranks[0][name]["named_budget"], (rank, name)
            run = case["with_budget"]
            assert "error" not in run, (rank, name, run.get("error"))
            assert run["peak"] <= case["named_budget"], (rank, name)
            _assert_same_training(run, case["cuda_same_chunks"])


def test_a_chunk_size_the_error_names_fits_the_budget(ranks: list[dict[str, Any]]) -> None:
    named = 0
    for rank, out in enumerate(ranks):
        for name, case in out.items():
            if "named_chunk" not in case:
                continue
            named += 1
            budget = int(name.split("/")[2])
            run = case["with_chunk"]
            assert "error" not in run, (rank, name, run.get("error"))
            assert run["chunk"] == case["named_chunk"]
            assert run["peak"] <= budget, (rank, name, run["peak"])
    # Named where chunks larger than needed make the working set: the two set sizes and the
    # LoRA model's searched size at 45,000 bytes.
    assert named >= 3 * len(ranks), named


def test_lora_trains_within_its_model_state(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        run = out["lora/at_model_state"]
        assert "error" not in run, run.get("error")
        assert run["peak"] <= out["lora/cuda"]["model_state"]
        _assert_same_training(run, out["lora/cuda"])


def test_the_error_says_when_the_working_set_exceeds_the_model_state(
    ranks: list[dict[str, Any]],
) -> None:
    for out in ranks:
        # Chunks of 16,384 elements gather most of the tiny LoRA model at once.
        message = out["lora/auto/55000/16384"]["first"]["error"]
        assert "more than the whole model state a rank keeps" in message, message
        # The searched chunks at 2,000 bytes: the working set is below the model state, and
        # no chunk size fits (the largest tensors alone take more).
        small = out["lora/auto/2000/None"]["first"]["error"]
        assert "more than the whole model state" not in small, small
        assert "no chunk size would fit this budget" in small, small
