"""The "auto" placement against the best "static" split at each device budget of a sweep.

    python benchmarks/bench_auto.py [--rounds 8] [--world 2]

A 6-block MLP at stage 3 (chunks of 4096 elements, fp32, AdamW) on forked gloo ranks. The sweep
runs from the working set ("cpu" placement's peak) to the whole model state in 8 budgets; at
each, "auto" and every static split of a small grid (offload_param_frac, offload_optim_frac in
0, 0.5, 1) that trains within the budget take one step each per round, in turn, for `--rounds`
rounds after one warm-up step, so that the machine's drift hits them alike. Reports rank 0's
median step time and bytes moved host<->device per step, and writes its block of
benchmarks/RESULTS.md (between the auto-placement markers).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.gemini import DeviceBudgetExceeded
from shardwise.testing import run_ranks

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN, END = "<!-- auto-placement:begin -->", "<!-- auto-placement:end -->"
GRID = [0.0, 0.5, 1.0]


class Block(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


class _Trainer:
    """One placement's copy of the model, stepped a turn at a time."""

    def __init__(self, policy: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = MLP()
        config = {"device": torch.device("cpu"), "chunk_size_numel": 4096, **policy}
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
        x = torch.randn(64, 64, generator=self.generator).chunk(dist.get_world_size())
        before = sum(self.gemini.bytes_moved().values())
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.optimizer.backward(self.wrapped(x[dist.get_rank()]))
        self.optimizer.step()
        if timed:
            self.times.append(time.perf_counter() - start)
            self.moved = sum(self.gemini.bytes_moved().values()) - before

    def result(self) -> dict[str, Any]:
        return {
            "ms": 1000 * statistics.median(self.times),
            "moved": self.moved,
            "peak": self.gemini.peak_device_bytes,
        }


def _trainer(policy: dict[str, Any]) -> _Trainer | None:
    """A trainer past its warm-up step, or None where the placement does not fit."""
    try:
        trainer = _Trainer(policy)
        trainer.step(timed=False)
    except DeviceBudgetExceeded:
        return None
    return trainer


def _interleaved(policies: dict[str, dict[str, Any]], rounds: int) -> dict[str, dict[str, Any]]:
    """Every placement that fits takes one step per round, in turn, so that the machine's
    drift hits them alike; each one's median step and the bytes its last step moved."""
    trainers = {name: _trainer(policy) for name, policy in policies.items()}
    live = {name: t for name, t in trainers.items() if t is not None}
    failed: set[str] = set()
    names = list(live)
    for turn in range(rounds):
        # The order rotates each round: no placement always follows the same one.
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            trainer = live[name]
            if name in failed:
                continue
            try:
                trainer.step(timed=True)
            except DeviceBudgetExceeded:
                failed.add(name)
    return {name: t.result() for name, t in live.items() if name not in failed and t.times}


def _sweep(rounds: int) -> list[dict[str, Any]]:
    cpu = _trainer({"placement_policy": "cpu"})
    cuda = _trainer({"placement_policy": "cuda"})
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
        results = _interleaved(policies, rounds)
        auto = results.pop("auto", None)
        best = min(results.items(), key=lambda item: item[1]["ms"], default=None)
        # The least of several noisy medians sits below their typical value: the median of
        # the splits that fit says how much of the gap to the best is that selection.
        typical = statistics.median(r["ms"] for r in results.values()) if results else None
        rows.append({"budget": budget, "auto": auto, "static": best, "typical": typical})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=16, help="timed steps per placement")
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    rows = run_ranks(_sweep, args.world, args.rounds, timeout_s=900)[0]
    lines = [
        BEGIN,
        "## Auto placement against the best static split, per device budget",
        "",
        f"`python benchmarks/bench_auto.py --rounds {args.rounds} --world {args.world}` (CPU,"
        " gloo, 6-block MLP, stage 3, chunks of 4096, fp32). At each budget auto and every"
        " static split (offload_param_frac x offload_optim_frac in {0, 0.5, 1}) that trains"
        " within it are built once and take one step each per round, in an order that rotates"
        " each round, after a warm-up step; rank 0's median step, and the bytes moved"
        " host<->device in the last one. Best static: the split with the lowest median (the"
        " least of up to nine noisy medians, which favours static); the last column compares"
        " auto with the median over the splits that fit.",
        "",
        "| budget (KiB) | auto ms | auto bytes moved | best static | static ms | static bytes "
        "| auto / best static | auto / median static |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        auto, static = row["auto"], row["static"]
        a = f"{auto['ms']:.1f} | {auto['moved']}" if auto else "fails | -"
        s = (
            f"{static[0]} | {static[1]['ms']:.1f} | {static[1]['moved']}"
            if static
            else "none fits | - | -"
        )
        ratio = f"{auto['ms'] / static[1]['ms']:.2f}" if auto and static else "-"
        typical = row["typical"]
        to_typical = f"{auto['ms'] / typical:.2f}" if auto and typical else "-"
        lines.append(f"| {row['budget'] / 1024:.0f} | {a} | {s} | {ratio} | {to_typical} |")
        print(lines[-1])
    lines.append(END)
    block = "\n".join(lines) + "\n"
    text = RESULTS.read_text() if RESULTS.exists() else ""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", re.S)
    text = pattern.sub(block, text) if pattern.search(text) else text + "\n" + block
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
