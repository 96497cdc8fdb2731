"""The seed API's contracts: state dicts, ColoDDP, and clear errors for wrong arguments."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, Run, batch_slice, make_model, reference

from shardwise import (
    ColoDDP,
    CommOp,
    zero_model_wrapper,
    zero_optim_wrapper,
)
from shardwise.testing import run_ranks

CPU = torch.device("cpu")


def _state_dict_round_trip(stage: int) -> dict[str, object]:
    rank = dist.get_rank()
    config: dict[str, object] = {"device": CPU}
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    source = zero_model_wrapper(make_model(), stage, config)
    full = source.state_dict(only_rank_0=False)
    rank0_only = source.state_dict()
    # A differently initialised model takes the state and then computes the same loss.
    torch.manual_seed(1234)
    target_module = make_model()
    for p in target_module.parameters():
        p.data.normal_()
    target = zero_model_wrapper(target_module, stage, config)
    result = target.load_state_dict(full)
    x, y = batch_slice(0, 0, rank, 2)
    with torch.no_grad():
        same = torch.equal(source(x, y), target(x, y))
    partial = dict(full)
    partial.pop("gpt.wpe.weight")
    partial["extra.weight"] = torch.zeros(1)
    lenient = target.load_state_dict(partial, strict=False)
    with pytest.raises(ValueError, match="missing keys"):
        target.load_state_dict(partial)
    wrong_shape = dict(full)
    wrong_shape["gpt.wpe.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"gpt\.wpe\.weight"):
        target.load_state_dict(wrong_shape)
    return {
        "keys": sorted(full),
        "rank0_only_empty": not rank0_only if rank else bool(rank0_only),
        "strict_result": (result.missing_keys, result.unexpected_keys),
        "lenient": (lenient.missing_keys, lenient.unexpected_keys),
        "same_output": same,
        "full": full,
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_dict_is_whole_unpadded_and_loads_back(stage: int) -> None:
    _, ref_state = reference(Run(steps=0))
    for result in run_ranks(_state_dict_round_trip, 2, stage):
        assert result["keys"] == sorted(ref_state)
        assert result["rank0_only_empty"]
        assert result["strict_result"] == ([], [])
        assert result["lenient"] == (["gpt.wpe.weight"], ["extra.weight"])
        assert result["same_output"]
        full = result["full"]
        assert isinstance(full, dict)
        for key, value in ref_state.items():
            assert full[key].shape == value.shape
            assert torch.equal(full[key], value), key


def _colo_ddp_train() -> tuple[list[float], dict[str, torch.Tensor]]:
    rank = dist.get_rank()
    model = ColoDDP(make_model(branch="some_ranks"), bucket_cap_mb=0.01)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(4):
        optimizer.zero_grad()
        loss = model(*batch_slice(step, 0, rank, 2))
        model.backward(loss)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total / 2))
    return losses, {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def test_colo_ddp_matches_reference_bit_exact() -> None:
    ref_losses, ref_state = reference(Run(branch="some_ranks"))
    for losses, state in run_ranks(_colo_ddp_train, 2):
        assert losses == ref_losses
        for key, value in ref_state.items():
            assert torch.equal(state[key], value), key


def _errors() -> list[str]:
    messages = []

    def expect(kind: type[Exception], pattern: str, fn: object) -> None:
        with pytest.raises(kind, match=pattern) as info:
            fn()  # type: ignore[operator]
        messages.append(str(info.value))

    model = make_model()
    expect(ValueError, "zero_stage must be 1, 2 or 3, got 4", lambda: zero_model_wrapper(model, 4))
    expect(TypeError, "zero_stage must be an int", lambda: zero_model_wrapper(model, "3"))
    expect(
        TypeError,
        "must be a torch.nn.Module",
        lambda: zero_model_wrapper("model", 3, {"device": CPU}),
    )
    expect(
        ValueError,
        r"gemini_config keys \['chunk_sise'\] are unknown",
        lambda: zero_model_wrapper(model, 3, {"device": CPU, "chunk_sise": 10}),
    )
    expect(
        ValueError,
        "placement_policy must be one of",
        lambda: zero_model_wrapper(model, 3, {"device": CPU, "placement_policy": "gpu"}),
    )
    expect(
        ValueError,
        "placement_policy='auto' needs a device budget",
        lambda: zero_model_wrapper(model, 3, {"device": CPU, "placement_policy": "auto"}),
    )
    expect(
        ValueError,
        "have no meaning at stage 2",
        lambda: zero_model_wrapper(model, 2, {"device": CPU, "device_budget_bytes": 10**9}),
    )
    wrapped = zero_model_wrapper(make_model(), 3, {"device": CPU})
    expect(
        TypeError,
        "must be a torch.optim.Optimizer",
        lambda: zero_optim_wrapper(wrapped, "adam"),  # type: ignore[arg-type]
    )
    foreign = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    expect(ValueError, "does not own", lambda: zero_optim_wrapper(wrapped, foreign))
    expect(
        ValueError,
        "applies to stages 1 and 2",
        lambda: zero_optim_wrapper(
            wrapped,
            torch.optim.SGD(wrapped.parameters(), lr=0.1),
            optim_config={"reduce_bucket_size": 10},
        ),
    )
    expect(
        ValueError,
        "backoff_factor",
        lambda: zero_optim_wrapper(
            wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), backoff_factor=1.5
        ),
    )
    expect(
        ValueError,
        "max_norm must be",
        lambda: zero_optim_wrapper(
            wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), max_norm=-1
        ),
    )
    expect(
        ValueError,
        r"strict_ddp_mode=True keeps every parameter replicated, so the 'auto' placement",
        lambda: zero_model_wrapper(
            make_model(), 3, {"device": CPU, "placement_policy": "auto", "strict_ddp_mode": True}
        ),
    )
    expect(
        TypeError,
        "model must be the result of zero_model_wrapper",
        lambda: zero_optim_wrapper(
            make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1)
        ),
    )
    return messages


def test_wrong_arguments_raise_clear_errors() -> None:
    messages = run_ranks(_errors, 2)[0]
    assert len(messages) == 14


def _ignored_params_keep_local_values() -> tuple[float, float]:
    rank = dist.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    torch.nn.init.constant_(model[0].weight, float(rank))
    torch.nn.init.constant_(model[1].weight, float(rank))
    ColoDDP.set_params_to_ignore([model[0].weight])
    ddp = ColoDDP(model)
    ddp.backward(ddp(torch.full((1, 2), float(rank + 1))).sum())
    return float(model[0].weight[0, 0]), float(model[1].weight[0, 0])


def test_colo_ddp_ignored_parameters_are_not_synchronised() -> None:
    results = run_ranks(_ignored_params_keep_local_values, 2)
    # The ignored weight keeps each rank's own value; the other one is rank 0's everywhere.
    assert results == [(0.0, 0.0), (1.0, 0.0)]


def _stage1_backward_after_step_without_zero_grad() -> str:
    rank = dist.get_rank()
    model = make_model()
    wrapped = zero_model_wrapper(model, 1, {"device": torch.device("cpu")})
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.SGD(model.parameters(), lr=0.1),
        optim_config={"reduce_bucket_size": CHUNK_NUMEL},
    )
    optimizer.backward(wrapped(*batch_slice(0, 0, rank, 2)))
    optimizer.step()
    try:
        optimizer.backward(wrapped(*batch_slice(1, 0, rank, 2)))
    except ValueError as error:
        return str(error)
    return "no error"


def test_stage1_refuses_a_backward_between_step_and_zero_grad() -> None:
    # Stage 1 keeps the reduced gradient in the rank's slice of the whole gradient buffer (the
    # ZeRO formula's memory): a backward before zero_grad() would add onto it.
    for message in run_ranks(_stage1_backward_after_step_without_zero_grad, 2):
        assert "call optimizer.zero_grad() between step() and the next backward" in message


def _packing_counts(bucket: int | None) -> dict[str, Any]:
    model = make_model()
    wrapped = zero_model_wrapper(model, 2, {"device": CPU})
    manager = wrapped.chunk_manager
    broadcasts = wrapped.comm_stats.calls(CommOp.BROADCAST)
    options = {"reduce_bucket_size": bucket} if bucket else None
    zero_optim_wrapper(wrapped, torch.optim.SGD(model.parameters(), lr=0.1), optim_config=options)
    return {
        "repacked": wrapped.chunk_manager is not manager,
        "chunks": len(wrapped.chunk_manager.chunks),
        "extra_broadcasts": wrapped.comm_stats.calls(CommOp.BROADCAST) - broadcasts,
    }


def test_stages_1_and_2_are_packed_once_with_the_default_bucket_and_without_broadcasts_else() -> (
    None
):
    default = run_ranks(_packing_counts, 2, None)[0]
    assert default == {"repacked": False, "chunks": 1, "extra_broadcasts": 0}
    small = run_ranks(_packing_counts, 2, 3001)[0]
    # A bucket size of its own re-packs the chunks, from values every rank already shares.
    assert small["repacked"] and small["chunks"] > 1 and small["extra_broadcasts"] == 0
