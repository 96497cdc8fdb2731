"""The "auto" placement against the best "static" split at each device budget of a sweep.

    python benchmarks/bench_auto.py [--steps 6] [--world 2]

A 6-block MLP at stage 3 (chunks of 4096 elements, fp32, AdamW) on forked gloo ranks. The sweep
runs from the working set ("cpu" placement's peak) to the whole model state in 8 budgets; at
each, "auto" and every static split of a small grid (offload_param_frac, offload_optim_frac in
0, 0.5, 1) that trains within the budget, each for `--steps` steps after one warm-up step.
Reports rank 0's median step time and bytes moved host<->device per step, and writes its block
of benchmarks/RESULTS.md (between the auto-placement markers).
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


def _run(policy: dict[str, Any], steps: int) -> dict[str, Any] | None:
    torch.manual_seed(0)
    model = MLP()
    config = {"device": torch.device("cpu"), "chunk_size_numel": 4096, **policy}
    wrapped = zero_model_wrapper(model, 3, config)
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3))
    gemini = wrapped.gemini_manager
    assert gemini is not None
    generator = torch.Generator().manual_seed(1)
    times, moved = [], 0
    try:
        for step in range(steps + 1):
            x = torch.randn(64, 64, generator=generator).chunk(dist.get_world_size())
            before = sum(gemini.bytes_moved().values())
            start = time.perf_counter()
            optimizer.zero_grad()
            optimizer.backward(wrapped(x[dist.get_rank()]))
            optimizer.step()
            if step > 0:
                times.append(time.perf_counter() - start)
                moved = sum(gemini.bytes_moved().values()) - before
    except DeviceBudgetExceeded:
        return None
    return {"ms": 1000 * statistics.median(times), "moved": moved, "peak": gemini.peak_device_bytes}


def _sweep(steps: int) -> list[dict[str, Any]]:
    cpu = _run({"placement_policy": "cpu"}, 1)
    cuda = _run({"placement_policy": "cuda"}, 1)
    assert cpu is not None and cuda is not None
    low, high = cpu["peak"], cpu["peak"] + cuda["peak"] * 2
    rows = []
    for i in range(8):
        budget = low + (high - low) * i // 7
        auto = _run({"placement_policy": "auto", "device_budget_bytes": budget}, steps)
        best: tuple[float, str, int] | None = None
        for param in GRID:
            for optim in GRID:
                split = {"offload_param_frac": param, "offload_optim_frac": optim}
                static = _run(
                    {"placement_policy": "static", "device_budget_bytes": budget, **split}, steps
                )
                if static is not None and (best is None or static["ms"] < best[0]):
                    best = (static["ms"], f"param {param}, optim {optim}", static["moved"])
        rows.append({"budget": budget, "auto": auto, "static": best})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    rows = run_ranks(_sweep, args.world, args.steps, timeout_s=600)[0]
    lines = [
        BEGIN,
        "## Auto placement against the best static split, per device budget",
        "",
        f"`python benchmarks/bench_auto.py --steps {args.steps} --world {args.world}` (CPU, gloo,"
        " 6-block MLP, stage 3, chunks of 4096, fp32). Rank 0, median of the steps after warm-up;"
        " bytes moved host<->device in the last step. Static: the fastest of offload_param_frac x"
        " offload_optim_frac in {0, 0.5, 1} that trains within the budget.",
        "",
        "| budget (KiB) | auto ms | auto bytes moved | best static | static ms | static bytes |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        auto, static = row["auto"], row["static"]
        a = f"{auto['ms']:.1f} | {auto['moved']}" if auto else "fails | -"
        s = f"{static[1]} | {static[0]:.1f} | {static[2]}" if static else "none fits | - | -"
        lines.append(f"| {row['budget'] / 1024:.0f} | {a} | {s} |")
        print(lines[-1])
    lines.append(END)
    block = "\n".join(lines) + "\n"
    text = RESULTS.read_text() if RESULTS.exists() else ""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", re.S)
    text = pattern.sub(block, text) if pattern.search(text) else text + "\n" + block
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
