"""The "auto" placement against the best "static" split at each device budget of a sweep.

    python benchmarks/bench_auto.py [--rounds 16] [--world 2] [--copies 6]
    python benchmarks/bench_auto.py --device cuda --world 1 --dim 1024 --hidden 4096 \
        --blocks 8 --chunk 4194304 --batch 8192      (one GPU: placement then moves real bytes)

A small MLP at stage 3 (by default 6 blocks, chunks of 4096 elements, fp32, AdamW) on forked
gloo ranks. The sweep runs from the working set ("cpu" placement's peak) to the whole model
state in 8 budgets. At each, in two runs:
1. selection: "auto" and every static split of a small grid (offload_param_frac,
   offload_optim_frac in 0, 0.5, 1) that trains within the budget take one step each per round,
   in an order that rotates each round, for `--rounds` rounds after one warm-up step; the split
   with the lowest median step is the best static split;
2. confirmation: fresh copies of "auto" and of that split (`--copies` each, every one built
   anew) take one step each per round, in a shuffled order (seeded), for three times as many
   rounds. A copy's step time carries an effect of its build (where its buffers landed) that
   no number of rounds averages out, so each side's time is the mean of its copies' medians,
   and auto / split is their ratio; the ratio of one half of the split's copies to the other
   half, measured alike, is the noise floor of that comparison. The least of nine noisy
   medians sits below its split's typical value (the winner's curse); timing fresh copies
   apart from the selection removes that bias.
Auto's own cost is timed too: the time its copies spend making room before each gather and
prefetch and after each allocation that passed the budget (the planning, waits and evictions
that "static" does not do), per step.
Reports rank 0's times and bytes moved host<->device per step, and writes its block of
benchmarks/RESULTS.md (between the auto-placement markers; a CUDA run writes a block of its
own).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.gemini import DeviceBudgetExceeded
from shardwise.testing import run_ranks

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
GRID = [0.0, 0.5, 1.0]
READING = (
    "On a CPU host both pools are the same memory, so placement changes the step time by no"
    " more than two sets of copies of one split, timed alike, differ (the noise floor): this"
    " run can show auto keeping pace with the best split, not beating it. The byte columns"
    " are what placement changes here; auto moves more than the fewest-bytes static split"
    " where it keeps room for the traced activations and for backward's prefetch, which a"
    " static split's budget check ignores. Auto's planning is the cost of deciding: where its"
    " plan holds the warm-up's peak it makes no room before gathers and costs under a tenth"
    " of a millisecond per step; at the working set, where the activations do"
    " not fit beside it, it waits for reductions in flight at the gathers where that makes"
    " room for them (no static split holds the activations there: fourth column)."
)


@dataclass(frozen=True)
class Setup:
    """The benchmarked model and where it computes (the defaults: the CPU run of RESULTS)."""

    device: str = "cpu"
    dim: int = 64
    hidden: int = 256
    blocks: int = 6
    chunk_size_numel: int = 4096
    batch: int = 64


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self, setup: Setup) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(setup.dim, setup.hidden) for _ in range(setup.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


class _Trainer:
    """One placement's copy of the model, stepped a turn at a time."""

    def __init__(self, policy: dict[str, Any], setup: Setup) -> None:
        torch.manual_seed(0)
        model = MLP(setup)
        self.setup = setup
        self.device = torch.device(setup.device)
        config = {"device": self.device, "chunk_size_numel": setup.chunk_size_numel, **policy}
        self.wrapped = zero_model_wrapper(model, 3, config)
        self.optimizer = zero_optim_wrapper(
            self.wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3)
        )
        gemini = self.wrapped.gemini_manager
        assert gemini is not None
        self.gemini = gemini
        self.generator = torch.Generator().manual_seed(1)
        self.times: list[float] = []
        self.plan_times: list[float] = []
        self.moved = 0
        # Time spent in auto's own work, which "static" does not do: making room before
        # gathers and prefetches, and after an allocation that passed the budget.
        self.planning = 0.0
        if gemini.auto is not None:
            for hook in ("before_gather", "before_prefetch"):
                setattr(gemini, hook, self._timed(getattr(gemini, hook)))
            gemini.auto.relieve = self._timed(gemini.auto.relieve)  # type: ignore[method-assign]

    def _timed(self, hook: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            hook(*args, **kwargs)
            self.planning += time.perf_counter() - start

        return timed

    def step(self, timed: bool) -> None:
        setup = self.setup
        x = torch.randn(setup.batch, setup.dim, generator=self.generator)
        x = x.chunk(dist.get_world_size())[dist.get_rank()].to(self.device)
        before = sum(self.gemini.bytes_moved().values())
        self._synchronize()
        planning = self.planning
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.optimizer.backward(self.wrapped(x))
        self.optimizer.step()
        self._synchronize()
        if timed:
            self.times.append(time.perf_counter() - start)
            self.plan_times.append(self.planning - planning)
            self.moved = sum(self.gemini.bytes_moved().values()) - before

    def _synchronize(self) -> None:
        # CUDA runs asynchronously: a step's time is measured to its last kernel.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def result(self) -> dict[str, Any]:
        return {
            "ms": 1000 * statistics.median(self.times),
            "times": self.times,
            "planning_ms": 1000 * statistics.median(self.plan_times),
            "moved": self.moved,
            "peak": self.gemini.peak_device_bytes,
            # The activations' peak auto traced (the same under every placement).
            "activations": max(auto.non_model, default=0) if (auto := self.gemini.auto) else 0,
        }


def _trainer(policy: dict[str, Any], setup: Setup) -> _Trainer | None:
    """A trainer past its warm-up step, or None where the placement does not fit."""
    try:
        trainer = _Trainer(policy, setup)
        trainer.step(timed=False)
    except DeviceBudgetExceeded:
        return None
    return trainer


def _interleaved(
    policies: dict[str, dict[str, Any]], rounds: int, setup: Setup, shuffled: bool = False
) -> dict[str, dict[str, Any]]:
    """Every placement that fits takes one step per round, in turn, so that the machine's
    drift hits them alike; each one's median step and the bytes its last step moved. The
    order rotates each round, or is shuffled (seeded: every rank and run alike)."""
    trainers = {name: _trainer(policy, setup) for name, policy in policies.items()}
    live = {name: t for name, t in trainers.items() if t is not None}
    failed: set[str] = set()
    names = list(live)
    shuffle = random.Random(0).shuffle
    for turn in range(rounds):
        order = names[turn % len(names) :] + names[: turn % len(names)]
        if shuffled:
            shuffle(order)
        for name in order:
            trainer = live[name]
            if name in failed:
                continue
            try:
                trainer.step(timed=True)
            except DeviceBudgetExceeded:
                failed.add(name)
    return {name: t.result() for name, t in live.items() if name not in failed and t.times}


def _confirmation(
    auto: dict[str, Any], split: dict[str, Any], copies: int, rounds: int, setup: Setup
) -> dict[str, Any] | None:
    """Fresh copies of auto and of the split, interleaved: each side's mean of its copies'
    medians, their ratio, and the ratio of one half of the split's copies to the other (the
    noise floor); None where a copy failed."""
    # Built in turns, so that neither side's copies all land where the heap stood at one
    # time.
    policies = {}
    for i in range(copies):
        policies |= {f"auto {i}": auto, f"split {i}": split}
    results = _interleaved(policies, rounds, setup, shuffled=True)
    if len(results) < len(policies):
        return None
    mine = [results[f"auto {i}"]["ms"] for i in range(copies)]
    theirs = [results[f"split {i}"]["ms"] for i in range(copies)]
    half = copies // 2
    return {
        "auto_ms": statistics.mean(mine),
        "split_ms": statistics.mean(theirs),
        "ratio": statistics.mean(mine) / statistics.mean(theirs),
        "floor": statistics.mean(theirs[:half]) / statistics.mean(theirs[half:]),
        "planning_ms": statistics.mean(results[f"auto {i}"]["planning_ms"] for i in range(copies)),
    }


def _sweep(rounds: int, copies: int, setup: Setup) -> list[dict[str, Any]]:
    cpu = _trainer({"placement_policy": "cpu"}, setup)
    cuda = _trainer({"placement_policy": "cuda"}, setup)
    assert cpu is not None and cuda is not None
    for reference in (cpu, cuda):
        reference.step(timed=False)  # the first step creates the optimizer state
    low = cpu.gemini.peak_device_bytes
    high = low + cuda.gemini.peak_device_bytes * 2
    rows = []
    for i in range(8):
        budget = low + (high - low) * i // 7
        policies = {"auto": {"placement_policy": "auto", "device_budget_bytes": budget}}
        for param in GRID:
            for optim in GRID:
                policies[f"param {param}, optim {optim}"] = {
                    "placement_policy": "static",
                    "device_budget_bytes": budget,
                    "offload_param_frac": param,
                    "offload_optim_frac": optim,
                }
        results = _interleaved(policies, rounds, setup)
        auto = results.pop("auto", None)
        best = min(results.items(), key=lambda item: item[1]["ms"], default=None)
        confirmed = None
        if auto is not None and best is not None:
            confirmed = _confirmation(
                policies["auto"], policies[best[0]], copies, 3 * rounds, setup
            )
        fewest = min((r["moved"] for r in results.values()), default=None)
        # The splits a real device holds: their model-state peak and the activations' peak
        # within the budget (an upper bound of their peak together).
        activations = auto["activations"] if auto is not None else 0
        holds = [r["moved"] for r in results.values() if r["peak"] + activations <= budget]
        rows.append(
            {
                "budget": budget,
                "fewest_moved": fewest,
                "fewest_held": min(holds, default=None),
                "auto": auto,
                "static": best,
                "confirmed": confirmed,
            }
        )
    return rows


def _table_row(row: dict[str, Any]) -> str:
    budget = f"{row['budget'] / 1024:.0f}"
    auto, static, confirmed = row["auto"], row["static"], row["confirmed"]
    if auto is None or static is None:
        failed = "fails" if auto is None else "-"
        return f"| {budget} | {failed} | - | - | none fits | - | - | - | - | - |"
    name, chosen = static
    held = "none" if row["fewest_held"] is None else row["fewest_held"]
    first = (
        f"| {budget} | {auto['moved']} | {row['fewest_moved']} | {held} | {name} |"
        f" {chosen['moved']} |"
    )
    if confirmed is None:
        return f"{first} - | - | - | - |"
    return (
        f"{first} {confirmed['auto_ms']:.1f} / {confirmed['split_ms']:.1f} |"
        f" {confirmed['ratio']:.3f} | {confirmed['floor']:.3f} |"
        f" {confirmed['planning_ms']:.2f} ({confirmed['planning_ms'] / confirmed['auto_ms']:.1%}) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=16, help="timed steps per placement")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--copies", type=int, default=6, help="fresh copies of auto and of the split confirmed"
    )
    parser.add_argument("--device", default="cpu", help='"cpu", or "cuda" (one GPU: --world 1)')
    parser.add_argument("--dim", type=int, default=Setup.dim)
    parser.add_argument("--hidden", type=int, default=Setup.hidden)
    parser.add_argument("--blocks", type=int, default=Setup.blocks)
    parser.add_argument("--chunk", type=int, default=Setup.chunk_size_numel, help="elements")
    parser.add_argument("--batch", type=int, default=Setup.batch, help="global batch")
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="the Markdown file whose block it writes"
    )
    args = parser.parse_args()
    if args.device == "cuda" and args.world != 1:
        parser.error("--device cuda runs one rank per GPU over gloo: pass --world 1")
    if args.copies < 2:
        parser.error(
            f"--copies must be at least 2 (the noise floor halves them), got {args.copies}"
        )
    setup = Setup(args.device, args.dim, args.hidden, args.blocks, args.chunk, args.batch)
    rows = run_ranks(_sweep, args.world, args.rounds, args.copies, setup, timeout_s=1800)[0]
    # One block per device kind: a CUDA run leaves the CPU run's table in place.
    name = "auto-placement" if setup.device == "cpu" else f"auto-placement-{setup.device}"
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    command = " ".join(["python benchmarks/bench_auto.py", *sys.argv[1:]])
    model = (
        f"{setup.blocks}-block MLP (dim {setup.dim}, hidden {setup.hidden}), batch"
        f" {setup.batch}, stage 3, chunks of {setup.chunk_size_numel}, fp32"
    )
    where = "CPU, gloo" if setup.device == "cpu" else f"{_device_name(setup.device)}, gloo"
    lines = [
        begin,
        f"## Auto placement against the best static split, per device budget ({setup.device})",
        "",
        f"`{command}` ({where}, {args.world} rank(s), {model}). Selection: at each budget auto"
        " and every static split (offload_param_frac x offload_optim_frac in {0, 0.5, 1})"
        " that trains within it take one step each per round, in an order that rotates each"
        f" round, {args.rounds} rounds after a warm-up step; the split with the lowest median"
        " is the best static split (the least of nine noisy medians is biased low, so it is"
        " timed again). Confirmation: fresh copies of auto and of that split"
        f" ({args.copies} each, every one built anew) take one step each per round, in a"
        f" shuffled order, for {3 * args.rounds} rounds. A copy's step time carries an effect"
        " of its build (where its buffers landed) that more rounds do not average out, so each"
        " side's time is the mean of its copies' median steps, and auto / best static is their"
        " ratio; the same ratio between the two halves of the split's copies is the noise floor"
        " of that comparison (1.000 would be no noise). Auto's planning is the time its copies"
        " spend making room before each gather and prefetch and after each allocation that"
        " passed the budget (forecasts, waits and evictions, which static splits do not do), per"
        " step. Rank 0's times, and the bytes moved"
        " host<->device in the last step. The static splits' budget check counts model state"
        " only; auto's also leaves room for the activations it traced, which a real device"
        " must hold too: the fourth column counts only the splits whose model-state peak and"
        " the activations' peak (auto's trace, the same under every placement) sum within the"
        " budget, an upper bound of what they hold at once.",
        "",
        "| budget (KiB) | auto bytes moved | fewest bytes of a static split | of one that also"
        " holds the activations | best static | its bytes | confirmation ms: auto / static"
        " | auto / best static | split / split (noise floor) | auto's planning ms/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(_table_row(row))
        print(lines[-1])
    if setup.device == "cpu":
        lines += ["", READING]
    lines.append(end)
    block = "\n".join(lines) + "\n"
    results: Path = args.results
    text = results.read_text() if results.exists() else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text + "\n" + block
    results.write_text(text)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device


if __name__ == "__main__":
    main()
