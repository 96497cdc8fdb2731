"""gloo's collectives on this machine, at a given size: what a step's traffic costs.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_collectives.py --numel N --out c.json

DDP reduces gradients with one all-reduce; ZeRO stages 1-2 with a reduce-scatter and then an
all-gather of the updated parameters, stage 3 with two all-gathers and a reduce-scatter. Their
bytes on the wire are the same or fewer, but their times depend on how well the backend
implements each collective. The reduce-scatter is timed both as gloo's own and as shardwise
runs it on gloo (an all-to-all and a local sum, `comm.reduce_to_shard`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise.comm import CommStats, ReduceScatterMethod, reduce_to_shard


def timed(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, required=True, help="fp32 elements (the model's psi)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    numel = -(-args.numel // world) * world
    full = torch.randn(numel)
    shard = torch.empty(numel // world)
    timings = {
        "all_reduce_ms": timed(lambda: dist.all_reduce(full), args.repeats),
        "reduce_scatter_ms": timed(lambda: dist.reduce_scatter_single(shard, full), args.repeats),
        "all_gather_ms": timed(lambda: dist.all_gather_single(full, shard), args.repeats),
        "all_to_all_reduce_scatter_ms": timed(
            lambda: reduce_to_shard(full, ReduceScatterMethod.ALL_TO_ALL, CommStats()),
            args.repeats,
        ),
    }
    if dist.get_rank() == 0:
        with open(args.out, "w") as handle:
            json.dump({"numel": numel, "world": world, **timings}, handle, indent=1)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
