"""One engine's training step on every rank torchrun starts; rank 0 writes a JSON summary.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_step.py --engine zero3-cuda \
        --out r.json

Engines (engines.py): ddp (torch DistributedDataParallel), fsdp1, fsdp2 (torch fully_shard per
block and root), zero1, zero2, zero3-cuda, zero3-cpu (shardwise). Same model, seed and global
batch for all, fp32 compute, AdamW (fused) everywhere. A run of its own gives what one process
shows alone: bytes sent, model-state bytes, peak memory, a profile; step-time ratios come from
bench_ab.py, which interleaves engines in one process group.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import resource
import statistics
import time

import torch
import torch.distributed as dist
from engines import EngineSpec, add_model_arguments, build, model_config

from shardwise.testing import GPT, gpt_batch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--engine", required=True, type=EngineSpec.parse,
        help="ddp, fsdp1, fsdp2, zero1, zero2, zero3-cuda, zero3-cpu, with suffixes +sync, "
        "+telemetry, -rs, -a2a, -ar (see engines.py)",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="share of time in shardwise code")
    parser.add_argument("--out", required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    add_model_arguments(parser)
    return parser.parse_args()


def _shardwise_share(profiler: cProfile.Profile, total_s: float) -> float:
    """Share of the measured steps spent in shardwise's own Python code (hooks, state
    bookkeeping, the optimizer wrapper): time inside its functions less the torch calls they
    make (cProfile's own time per function)."""
    stats = pstats.Stats(profiler)
    own = sum(
        entry[2]  # total time spent in the function itself
        for (filename, _, _), entry in stats.stats.items()  # type: ignore[attr-defined]
        if "/shardwise/" in filename and "/testing/" not in filename
    )
    return own / total_s


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = model_config(args)
    model = GPT(config)
    num_params = model.num_parameters()
    spec = args.engine
    step, counters = build(spec, model, args.chunk_mib)
    times, sent = [], []
    loss = torch.zeros(())
    profiler = cProfile.Profile() if args.profile and rank == 0 else None
    telemetry_cpu_s = 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            telemetry_cpu_s = -counters().get("telemetry_cpu_s", 0.0)
        idx, targets = gpt_batch(config, args.batch, args.seq, i)
        before = counters().get("sent_bytes", 0)
        dist.barrier()
        measured = i >= args.warmup
        if profiler is not None and measured:
            profiler.enable()
        start = time.perf_counter()
        loss = step(idx.chunk(world)[rank], targets.chunk(world)[rank])
        elapsed = time.perf_counter() - start
        if profiler is not None and measured:
            profiler.disable()
        if i >= args.warmup:
            times.append(elapsed * 1000)
            sent.append(counters().get("sent_bytes", 0) - before)
    time.sleep(0.5)  # let the telemetry thread deliver the last step's events
    telemetry_cpu_s += counters().get("telemetry_cpu_s", 0.0)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if rank == 0:
        summary = {
            "engine": spec.name,
            "world": world,
            "params": num_params,
            "median_ms": statistics.median(times),
            "step_ms": times,
            "final_loss": float(loss),
            "sent_bytes_per_step": statistics.median(sent) if sent and sent[0] else None,
            "model_state_bytes": counters().get("model_state_bytes"),
            "peak_rss_mib": peak_kib / 1024,
            "telemetry": spec.telemetry,
            "telemetry_cpu_ms_per_step": telemetry_cpu_s * 1000 / args.steps,
        }
        if profiler is not None:
            summary["shardwise_python_share"] = _shardwise_share(profiler, sum(times) / 1000)
        with open(args.out, "w") as handle:
            json.dump(summary, handle, indent=1)
    # DDP's reducer can hold the last reference to the process group and destroy it from C++
    # with the interpreter lock held while gloo threads wait for that lock: drop every engine
    # object and synchronise first.
    del step, counters
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
