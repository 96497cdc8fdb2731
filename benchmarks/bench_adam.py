"""HybridAdam against torch's fused AdamW on one large fp32 shard (one process).

python benchmarks/bench_adam.py --numel 50000000 --out adam.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shardwise import HybridAdam


def time_steps(optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours = torch.randn(args.numel)
    theirs = ours.clone()
    ours.grad = torch.randn(args.numel)
    theirs.grad = ours.grad.clone()
    hybrid = HybridAdam([ours], lr=1e-3, weight_decay=0.01)
    fused = torch.optim.AdamW([theirs], lr=1e-3, weight_decay=0.01, fused=True)
    hybrid_ms: list[float] = []
    fused_ms: list[float] = []
    # Interleaved rounds, one warm-up step each first: timings drift here, ratios hold.
    for _ in range(args.rounds):
        time_steps(hybrid, 1)
        hybrid_ms += time_steps(hybrid, args.steps)
        time_steps(fused, 1)
        fused_ms += time_steps(fused, args.steps)
    # Parameter, gradient and two moments read, parameter and moments written: 7 x 4 bytes.
    moved = 7 * 4 * args.numel
    summary = {
        "numel": args.numel,
        "threads": args.threads,
        "hybrid_adam_ms": statistics.median(hybrid_ms),
        "fused_adamw_ms": statistics.median(fused_ms),
        "hybrid_gb_per_s": moved / statistics.median(hybrid_ms) / 1e6,
        "identical": bool(torch.equal(ours, theirs)),
    }
    with open(args.out, "w") as handle:
        json.dump(summary, handle, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
