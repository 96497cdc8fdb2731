"""The "auto" placement against the best "static" split at each device budget of a sweep.

    python benchmarks/bench_auto.py [--rounds 16] [--world 2]
    python benchmarks/bench_auto.py --device cuda --world 1 --dim 1024 --hidden 4096 \
        --blocks 8 --chunk 4194304 --batch 8192      (one GPU: placement then moves real bytes)

A small MLP at stage 3 (by default 6 blocks, chunks of 4096 elements, fp32, AdamW) on forked
gloo ranks. The sweep runs from the working set ("cpu" placement's peak) to the whole model
state in 8 budgets. At each, in two runs:
1. selection: "auto" and every static split of a small grid (offload_param_frac,
   offload_optim_frac in 0, 0.5, 1) that trains within the budget take one step each per round,
   in an order that rotates each round, for `--rounds` rounds after one warm-up step; the split
   with the lowest median step is the best static split;
2. confirmation: "auto", that split and a second copy of it, freshly built, take turns for six
   times as many rounds in each of the six orders alike; auto's ratio to the split is the
   median of their per-round ratios, and the copy's ratio to the split, measured alike, is the
   noise floor of that comparison. The least of nine noisy medians sits below its split's
   typical value (the winner's curse); timing it again apart from its selection removes that
   bias.
Reports rank 0's times and bytes moved host<->device per step, and writes its block of
benchmarks/RESULTS.md (between the auto-placement markers; a CUDA run writes a block of its
own).
"""

from __future__ import annotations

import argparse
import itertools
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
    " more than two copies of one split, timed alike, differ (the last column): this run "
    "can show auto keeping pace with the best split, not beating it. The byte columns are "
    "what placement changes here; auto moves more than the fewest-bytes static split where "
    "it keeps room for the traced activations and for backward's prefetch, which a static "
    "split's budget check ignores."
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
        self.moved = 0

    def step(self, timed: bool) -> None:
        setup = self.setup
        x = torch.randn(setup.batch, setup.dim, generator=self.generator)
        x = x.chunk(dist.get_world_size())[dist.get_rank()].to(self.device)
        before = sum(self.gemini.bytes_moved().values())
        self._synchronize()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.optimizer.backward(self.wrapped(x))
        self.optimizer.step()
        self._synchronize()
        if timed:
            self.times.append(time.perf_counter() - start)
            self.moved = sum(self.gemini.bytes_moved().values()) - before

    def _synchronize(self) -> None:
        # CUDA runs asynchronously: a step's time is measured to its last kernel.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def result(self) -> dict[str, Any]:
        return {
            "ms": 1000 * statistics.median(self.times),
            "times": self.times,
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
    policies: dict[str, dict[str, Any]], rounds: int, setup: Setup
) -> dict[str, dict[str, Any]]:
    """Every placement that fits takes one step per round, in turn, so that the machine's
    drift hits them alike; each one's median step and the bytes its last step moved."""
    trainers = {name: _trainer(policy, setup) for name, policy in policies.items()}
    live = {name: t for name, t in trainers.items() if t is not None}
    failed: set[str] = set()
    names = list(live)
    # Each round another order: every permutation in turn where there are few placements (so
    # each follows each other as often, and a step's cost of the caches the previous one left
    # evens out), otherwise the order rotates.
    if len(names) <= 3:
        orders = [list(order) for order in itertools.permutations(names)]
    else:
        orders = [names[shift:] + names[:shift] for shift in range(len(names))]
    for turn in range(rounds):
        for name in orders[turn % len(orders)]:
            trainer = live[name]
            if name in failed:
                continue
            try:
                trainer.step(timed=True)
            except DeviceBudgetExceeded:
                failed.add(name)
    return {name: t.result() for name, t in live.items() if name not in failed and t.times}


def _sweep(rounds: int, setup: Setup) -> list[dict[str, Any]]:
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
        head_to_head = None
        if auto is not None and best is not None:
            # The best split twice: its second copy against the first is the comparison's
            # noise floor (an A/A control).
            trio = {
                "auto": policies["auto"],
                best[0]: policies[best[0]],
                "again": policies[best[0]],
            }
            head_to_head = _interleaved(trio, 6 * rounds, setup)
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
                "confirmed": head_to_head,
            }
        )
    return rows


def _paired(top: dict[str, Any], bottom: dict[str, Any]) -> float:
    """The median over rounds of one step's time over the other's in the same round: the
    drift of the machine cancels within a round."""
    return statistics.median(a / b for a, b in zip(top["times"], bottom["times"], strict=True))


def _table_row(row: dict[str, Any]) -> str:
    budget = f"{row['budget'] / 1024:.0f}"
    auto, static, confirmed = row["auto"], row["static"], row["confirmed"]
    if auto is None or static is None:
        failed = "fails" if auto is None else "-"
        return f"| {budget} | {failed} | - | - | none fits | - | - | - | - |"
    name, chosen = static
    held = "none" if row["fewest_held"] is None else row["fewest_held"]
    first = (
        f"| {budget} | {auto['moved']} | {row['fewest_moved']} | {held} | {name} |"
        f" {chosen['moved']} |"
    )
    mine, again, control = (confirmed.get(k) for k in ("auto", name, "again"))
    if mine is None or again is None or control is None:
        return f"{first} - | - | - |"
    return (
        f"{first} {mine['ms']:.1f} / {again['ms']:.1f} | {_paired(mine, again):.2f}"
        f" | {_paired(control, again):.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=16, help="timed steps per placement")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--device", default="cpu", help='"cpu", or "cuda" (one GPU: --world 1)')
    parser.add_argument("--dim", type=int, default=Setup.dim)
    parser.add_argument("--hidden", type=int, default=Setup.hidden)
    parser.add_argument("--blocks", type=int, default=Setup.blocks)
    parser.add_argument("--chunk", type=int, default=Setup.chunk_size_numel, help="elements")
    parser.add_argument("--batch", type=int, default=Setup.batch, help="global batch")
    args = parser.parse_args()
    if args.device == "cuda" and args.world != 1:
        parser.error("--device cuda runs one rank per GPU over gloo: pass --world 1")
    setup = Setup(args.device, args.dim, args.hidden, args.blocks, args.chunk, args.batch)
    rows = run_ranks(_sweep, args.world, args.rounds, setup, timeout_s=900)[0]
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
        " timed again). Confirmation: auto, that split, and a second copy of that split, built"
        f" afresh, take turns for {6 * args.rounds} rounds, in each of the six orders alike."
        " Auto / best static is the median over rounds of auto's step over the split's in the"
        " same round; the copy's ratio to the split, measured alike, is the noise floor of"
        " that comparison (1.00 would be no noise). Rank 0's times, and the bytes moved"
        " host<->device in the last step. The static splits' budget check counts model state"
        " only; auto's also leaves room for the activations it traced, which a real device"
        " must hold too: the fourth column counts only the splits whose model-state peak and"
        " the activations' peak (auto's trace, the same under every placement) sum within the"
        " budget, an upper bound of what they hold at once.",
        "",
        "| budget (KiB) | auto bytes moved | fewest bytes of a static split | of one that also"
        " holds the activations | best static | its bytes | confirmation ms: auto / static"
        " | auto / best static | same split twice |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(_table_row(row))
        print(lines[-1])
    if setup.device == "cpu":
        lines += ["", READING]
    lines.append(end)
    block = "\n".join(lines) + "\n"
    text = RESULTS.read_text() if RESULTS.exists() else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text + "\n" + block
    RESULTS.write_text(text)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device


if __name__ == "__main__":
    main()
