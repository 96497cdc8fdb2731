"""The "auto" policy over a sweep of device budgets, from the working set (the least at which
"cpu" placement trains) to the whole model state: every budget trains, to the same bits as
"cuda", and the bytes moved between host and device per step never rise as the budget grows."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, make_model

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.gemini import DeviceBudgetExceeded
from shardwise.testing import run_ranks

FP16 = MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32)
FP32 = MixedPrecision()
STEPS = 3  # the warm-up, then two planned steps
NUM_BUDGETS = 8


def _train(
    policy: dict[str, Any], world: int, mixed_precision: MixedPrecision = FP16
) -> dict[str, Any]:
    rank = dist.get_rank()
    config = {
        "device": torch.device("cpu"),
        "chunk_size_numel": CHUNK_NUMEL,
        "mixed_precision": mixed_precision,
        **policy,
    }
    model = make_model()
    wrapped = zero_model_wrapper(model, 3, config)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    gemini = wrapped.gemini_manager
    assert gemini is not None
    losses, moved, planned = [], 0, (0, 0)
    auto = gemini.auto
    for step in range(STEPS):
        before = gemini.bytes_moved()
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, world))
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss))
        after = gemini.bytes_moved()
        moved = sum(after.values()) - sum(before.values())  # the last step's
        if step == 0 and auto is not None:  # the warm-up, which ends with the plan
            planned = (auto.overruns, auto.evictions)
    return {
        "losses": losses,
        "state": wrapped.state_dict(),
        "moved": moved,
        "peak": gemini.peak_device_bytes,
        "device": gemini.memory_by_pool()["device"],
        "non_model": max(auto.non_model) if auto is not None else 0,
        "prefetch": auto.prefetch if auto is not None else None,
        "plan_holds": auto.plan_holds if auto is not None else None,
        # Budget overruns and evictions in the steps after the plan.
        "overruns": auto.overruns - planned[0] if auto is not None else 0,
        "evictions": auto.evictions - planned[1] if auto is not None else 0,
        # The plan's floor (working set and activations) and the room it keeps free.
        "planned": auto.warmup_peak + auto.reserved_bytes if auto is not None else 0,
    }


def _sweep(world: int) -> dict[str, Any]:
    cuda = _train({"placement_policy": "cuda"}, world)
    cpu = _train({"placement_policy": "cpu"}, world)
    # The working set: the most "cpu" placement ever holds on the device; the top: every
    # byte of model state, with the working set and the activations beside it.
    low = cpu["peak"]
    probe = _train({"placement_policy": "auto", "device_budget_bytes": 1 << 40}, world)
    # The plan estimates optimizer state before the first step creates it (two fp32 moments
    # per element of the shard): a tenth more covers what the estimate overshoots.
    high = (probe["planned"] + probe["device"]) * 11 // 10
    budgets = [low + (high - low) * i // (NUM_BUDGETS - 1) for i in range(NUM_BUDGETS)]
    runs = [
        _train({"placement_policy": "auto", "device_budget_bytes": budget}, world)
        for budget in budgets
    ]
    below = ""
    try:
        _train({"placement_policy": "auto", "device_budget_bytes": low // 2}, world)
    except DeviceBudgetExceeded as error:
        below = str(error)
    return {"cuda": cuda, "cpu": cpu, "budgets": budgets, "runs": runs, "below": below}


@pytest.mark.parametrize("world", [2, 4])
def test_auto_trains_at_every_budget_bit_identical_to_cuda(world: int) -> None:
    results = run_ranks(_sweep, world, world)
    for rank, result in enumerate(results):
        cuda, cpu = result["cuda"], result["cpu"]
        moved = [run["moved"] for run in result["runs"]]
        for budget, run in zip(result["budgets"], result["runs"], strict=True):
            assert run["losses"] == cuda["losses"], (rank, budget)
            for key, value in cuda["state"].items():
                assert torch.equal(run["state"][key], value), (rank, budget, key)
            # The model state never passes the budget (activations are planned for, and
            # counted in the peak, but cannot move).
            assert run["peak"] - run["non_model"] <= budget, (rank, budget)
        # Traffic only falls as the budget grows: from about what "cpu" moves at the
        # working set to nothing once the whole model state fits.
        assert all(a >= b for a, b in itertools.pairwise(moved)), (rank, moved)
        # At the working set itself "auto" has no room to plan a prefetch (so a chunk that
        # forward ends with is gathered again for backward); one step up it moves no more
        # than "cpu" does.
        assert moved[1] <= cpu["moved"], (rank, moved[1], cpu["moved"])
        assert moved[-1] == 0, (rank, moved)
        assert moved[0] > 0, (rank, moved)
        assert result["runs"][-1]["prefetch"] is True
        # Once the budget holds the warm-up's peak and the plan's reserve, steps skip making
        # room before their gathers (the plan holds): from some budget up, never below it;
        # and there the steps after the plan neither passed the budget nor evicted.
        holds = [run["plan_holds"] for run in result["runs"]]
        assert holds[0] is False and holds[-1] is True, holds
        assert holds == sorted(holds), holds
        for run in result["runs"]:
            if run["plan_holds"]:
                assert run["overruns"] == run["evictions"] == 0, (rank, run["overruns"])
        # Below the working set no placement fits, and the error names a budget that passes:
        # the warm-up's working set, no more than "cpu" placement's peak (which prefetches).
        named = re.search(r"device_budget_bytes=(\d+) passes the whole step", result["below"])
        assert named is not None, result["below"]
        assert int(named.group(1)) <= cpu["peak"], (rank, named.group(1), cpu["peak"])


def _overrun_then_replan() -> list[dict[str, Any]]:
    """Two plain steps (the warm-up plans for them), then steps of two micro-batches, the first
    under no_sync: every chunk then keeps its whole gradient until the synchronised backward,
    more than the plan foresaw. Run under "cuda" and under "auto" at budgets across the sweep."""
    rank = dist.get_rank()

    def train(policy: dict[str, Any]) -> dict[str, Any]:
        config = {"device": torch.device("cpu"), "chunk_size_numel": CHUNK_NUMEL, **policy}
        model = make_model()
        wrapped = zero_model_wrapper(model, 3, config)
        optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
        gemini = wrapped.gemini_manager
        assert gemini is not None
        history = []
        for step in range(6):
            optimizer.zero_grad()
            micro = 1 if step < 2 else 2
            for m in range(micro):
                loss = wrapped(*batch_slice(step, m, rank, 2))
                if m < micro - 1:
                    with wrapped.no_sync():
                        optimizer.backward(loss)
                else:
                    optimizer.backward(loss)
            optimizer.step()
            auto = gemini.auto
            history.append((auto.overruns, auto.replans) if auto is not None else (0, 0))
        return {"state": wrapped.state_dict(only_rank_0=False), "history": history}

    reference = train({"placement_policy": "cuda"})
    # Budgets in quarters of the fp32 parameters' bytes, from below the working set to above
    # what the model state and the held gradients take together.
    params = sum(v.numel() * v.element_size() for v in reference["state"].values())
    runs = []
    for quarters in range(2, 17):
        budget = params * quarters // 4
        try:
            run = train({"placement_policy": "auto", "device_budget_bytes": budget})
        except DeviceBudgetExceeded:
            continue  # no placement fits there: "cpu" needs the same gradient buffers
        same = all(torch.equal(run["state"][k], reference["state"][k]) for k in run["state"])
        runs.append({"budget": budget, "history": run["history"], "same": same})
    return runs


def test_a_step_past_the_plan_evicts_carries_on_and_plans_again() -> None:
    for runs in run_ranks(_overrun_then_replan, 2, timeout_s=240):
        assert all(run["same"] for run in runs)
        replanned = [run for run in runs if run["history"][-1][1] > 0]
        assert replanned, runs  # some budget was passed, so the plan was made again
        for run in replanned:
            overruns = [overruns for overruns, _ in run["history"]]
            replans = [replans for _, replans in run["history"]]
            # The plain steps kept to the plan; the first no_sync step passed it, so the plan
            # was made again after it, once: the same steps never again evict what the plan
            # kept (they may still pass the budget where the activations beside the held
            # gradients do, with nothing left to move, as under "cpu").
            assert overruns[:2] == [0, 0] and overruns[2] > 0, run
            assert replans == [0, 0, 1, 1, 1, 1], run
        # Where the new plan has room for the held gradients, no step passes it again.
        assert any(run["history"][-1][0] == run["history"][2][0] for run in replanned), runs


def _steady_waits(budget: int, mixed_precision: MixedPrecision) -> dict[str, int]:
    """ "auto" at `budget`: over the steps after the warm-up, its overruns and its waits for
    reductions in flight, and whether the model state alone ever passed the budget or the
    working set passed it; whether it planned a prefetch."""
    rank = dist.get_rank()
    config = {
        "device": torch.device("cpu"),
        "chunk_size_numel": CHUNK_NUMEL,
        "mixed_precision": mixed_precision,
        "placement_policy": "auto",
        "device_budget_bytes": budget,
    }
    model = make_model()
    wrapped = zero_model_wrapper(model, 3, config)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    gemini = wrapped.gemini_manager
    assert gemini is not None and gemini.auto is not None
    auto = gemini.auto
    drains = 0
    resume = gemini.resume

    def counted_resume() -> None:
        """Resume a decision paused for the reductions in flight, which the model has just
        finished: one wait for them, counted (see [Note: room after the reductions])."""
        nonlocal drains
        drains += 1
        resume()

    gemini.resume = counted_resume  # type: ignore[method-assign]
    for step in range(STEPS):
        optimizer.zero_grad()
        optimizer.backward(wrapped(*batch_slice(step, 0, rank, 2)))
        optimizer.step()
        if step == 0:  # after the warm-up
            drains, overruns = 0, auto.overruns
    return {
        "drains": drains,
        "overruns": auto.overruns - overruns,
        "prefetch": int(auto.prefetch),
        "model_over_budget": int(gemini.peak_model_device_bytes > budget),
        "working_over_budget": int(auto.working_peak > budget),
    }


def _waits_at_the_working_set() -> dict[str, int]:
    """ "auto" at the budget "cpu" placement peaks at: activations pass it beside the working
    set at many gathers."""
    return _steady_waits(_train({"placement_policy": "cpu"}, 2)["peak"], FP16)


def test_auto_keeps_reductions_overlapped_where_only_activations_pass_the_budget() -> None:
    # Waiting for a reduction in flight frees its buffers; where the activations pass the
    # budget by more than those hold, waiting cannot make the room. Every overrun used to
    # wait (drains >= overruns), serialising the step's reductions; now only those where
    # the wait does make the room do.
    for counts in run_ranks(_waits_at_the_working_set, 2):
        # The model state alone (and its transient part, the working set) stays within.
        assert counts["model_over_budget"] == counts["working_over_budget"] == 0, counts
        assert counts["overruns"] > 0, counts  # the activations do pass the budget
        assert counts["drains"] < counts["overruns"] // 2, counts


def _waits_where_the_activations_fit() -> dict[str, int]:
    """ "auto" at the budget "cpu" placement peaks at plus the activations' traced peak: the
    working set and the activations fit side by side, so nothing needs a wait. In fp32: a
    16-bit payload's gather briefly holds it beside its compute copy, which auto plans for and
    the budget checks after the gather do not see."""
    cpu = _train({"placement_policy": "cpu"}, 2, FP32)
    probe = _train({"placement_policy": "auto", "device_budget_bytes": 1 << 40}, 2, FP32)
    return _steady_waits(cpu["peak"] + probe["non_model"], FP32)


def test_auto_waits_for_no_reduction_where_the_working_set_and_activations_fit() -> None:
    # A chunk's reduction in flight leaves when the next one starts, as soon as the module's
    # first gradient chunk completes. Planning a backward gather as if the module's gradient
    # buffers all arrived beside it made "auto" wait for the reduction at every module
    # there, serialising the reductions that "cpu" placement keeps overlapped in the same
    # memory.
    for counts in run_ranks(_waits_where_the_activations_fit, 2):
        assert counts["prefetch"] == 1, counts
        assert counts["model_over_budget"] == 0, counts
        assert counts["drains"] == 0, counts
