"""fp16 / bf16 storage and communication, loss scaling and overflow handling across ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, make_model

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import run_ranks

FP16_STORAGE = MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32)


def _train_with_forced_overflow(stage: int, overflow_steps: tuple[int, ...]) -> dict[str, object]:
    rank = dist.get_rank()
    model = make_model()
    config: dict[str, object] = {"device": torch.device("cpu"), "mixed_precision": FP16_STORAGE}
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3), initial_scale=2**10, hysteresis=2
    )
    scales, stepped, states = [], [], []
    for step in range(5):
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, 2))
        if step in overflow_steps and rank == 1:
            # Only rank 1 overflows: fp16 gradients become inf when cast for the reduction.
            loss = loss * 1e30
        before = wrapped.state_dict(only_rank_0=False)
        optimizer.backward(loss)
        stepped.append(optimizer.step())
        after = wrapped.state_dict(only_rank_0=False)
        states.append(all(torch.equal(before[k], after[k]) for k in before))
        scales.append(optimizer.loss_scale)
    return {"scales": scales, "stepped": stepped, "unchanged": states}


def test_overflow_on_one_rank_skips_step_everywhere_and_backs_off_after_hysteresis() -> None:
    for stage in (2, 3):
        results = run_ranks(_train_with_forced_overflow, 2, stage, (1, 2))
        for result in results:
            assert result["stepped"] == [True, False, False, True, True]
            # Skipped steps leave every parameter as it was, on every rank.
            assert result["unchanged"] == [False, True, True, False, False]
            # hysteresis=2: the first overflow only counts, the second halves the scale.
            assert result["scales"] == [2**10, 2**10, 2**9, 2**9, 2**9]


def _fp16_run(stage: int, dtype: torch.dtype, param_gather: bool = False) -> list[float]:
    rank = dist.get_rank()
    model = make_model()
    precision = MixedPrecision(param_dtype=dtype, compute_dtype=torch.float32)
    config: dict[str, object] = {"device": torch.device("cpu"), "mixed_precision": precision}
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        optim_config={"overlap_param_gather": True} if param_gather else None,
    )
    losses = []
    for step in range(6):
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step % 2, 0, rank, 2))
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss))
    # Parameters are held as 16-bit payload: every rank sees the same values.
    state = wrapped.state_dict(only_rank_0=False)
    flat = torch.cat([v.flatten() for v in state.values()])
    everyone = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(everyone, flat)
    assert torch.equal(everyone[0], everyone[1])
    return losses


def test_16bit_storage_trains_and_ranks_agree() -> None:
    for stage in (1, 3):
        for dtype in (torch.float16, torch.bfloat16):
            for losses in run_ranks(_fp16_run, 2, stage, dtype):
                assert all(torch.isfinite(torch.tensor(losses)))
                assert losses[-1] < losses[0]


def _compute_dtype_is_used(dtype: torch.dtype) -> tuple[str, str]:
    model = torch.nn.Linear(4, 4)
    precision = MixedPrecision(param_dtype=dtype)
    wrapped = zero_model_wrapper(
        model, 3, {"device": torch.device("cpu"), "mixed_precision": precision}
    )
    out = wrapped(torch.ones(2, 4))
    forced = zero_model_wrapper(
        torch.nn.Linear(4, 4),
        3,
        {"device": torch.device("cpu"), "mixed_precision": precision, "force_outputs_fp32": True},
    )(torch.ones(2, 4))
    return str(out.dtype), str(forced.dtype)


def test_inputs_cast_to_compute_dtype_and_force_outputs_fp32() -> None:
    out_dtype, forced_dtype = run_ranks(_compute_dtype_is_used, 2, torch.bfloat16)[0]
    assert out_dtype == "torch.bfloat16"
    assert forced_dtype == "torch.float32"


def test_parameter_gather_overlapped_with_forward_keeps_16bit_results() -> None:
    # The 16-bit payload is gathered in the background and copied to the fp32 compute buffer
    # when a module first waits for it: the same numbers as the synchronous gather.
    for stage in (1, 2):
        overlapped = run_ranks(_fp16_run, 2, stage, torch.bfloat16, True)
        assert overlapped == run_ranks(_fp16_run, 2, stage, torch.bfloat16, False)
