"""What a dropped model leaves behind, round after round in one process, against torch's DDP
and FSDP2 in the same run.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        benchmarks/bench_lifecycle.py --size 117m --rounds 4 --results benchmarks/RESULTS.md

As a sweep, a notebook or a test suite does: for each engine, `--rounds` times, build the GPT,
wrap it, train two steps, drop every reference and collect garbage; after each round read, on
every rank, the tensor bytes still alive (every tensor the collector sees, each storage once:
what the process holds whatever its allocator keeps), the resident set (`VmRSS`) and, for the
disk tier, the files left in its folder. The engines run one after another in the same
processes, so the resident set carries the allocator's cache from one to the next; the tensor
bytes do not.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_memory import SIZES, _model_config, _status_kib, _write_block
from engines import EngineSpec, build

from shardwise.testing import GPT, gpt_batch

ENGINES = ("ddp", "fsdp2", "zero2", "zero3-cuda", "zero3-disk")


def live_tensor_mib() -> float:
    """MiB of every storage a tensor the garbage collector sees holds, each storage once."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.is_meta:
            continue
        try:
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (NotImplementedError, RuntimeError):
            continue  # a compiler's fake or functional tensor: no memory of its own
    return sum(seen.values()) / 2**20


def one_round(engine: str, args: argparse.Namespace) -> None:
    config = _model_config(args.size)
    torch.manual_seed(0)
    model = GPT(config)
    step, _ = build(EngineSpec.parse(engine), model, args.chunk_mib)
    rank, world = dist.get_rank(), dist.get_world_size()
    for i in range(2):
        idx, targets = gpt_batch(config, args.batch, config.block_size, i * world + rank)
        step(idx, targets)


def measure(
    engine: str, args: argparse.Namespace, disk: Path, baseline_mib: float
) -> list[dict[str, Any]]:
    rounds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        one_round(engine, args)
        # The last step's collectives may still hold their buffers until the peers finish
        # them (gloo's asynchronous work): wait for every rank, then collect.
        dist.barrier()
        gc.collect()
        rounds.append(
            {
                "tensor_mib": live_tensor_mib() - baseline_mib,
                "rss_mib": _status_kib("VmRSS") / 1024,
                "disk_files": sum(1 for p in disk.rglob("*") if p.is_file()),
                "seconds": time.perf_counter() - started,
            }
        )
    return rounds


def worst(per_rank: list[list[dict[str, Any]]], key: str, index: int) -> float:
    return max(float(rank[index][key]) for rank in per_rank)


def write_results(
    results: dict[str, list[list[dict[str, Any]]]], args: argparse.Namespace, path: Path
) -> None:
    command = (
        "OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node="
        f"{dist.get_world_size()} benchmarks/bench_lifecycle.py --size {args.size} --rounds "
        f"{args.rounds} --engines {args.engines} --results {path}"
    )
    lines = [
        "## A dropped model: what stays, round after round",
        "",
        f"Written by `{command}` on {time.strftime('%Y-%m-%d')}. Each round builds the "
        f"{args.size} GPT, wraps it, trains 2 steps and drops it (`gc.collect()`); after each "
        "round, the worse of the ranks: tensor bytes alive (every tensor the collector sees, "
        "each storage once, less those alive before the first engine), the resident set "
        "(VmRSS: the engines run one after another in the same processes, so it carries the "
        "allocator's cache along), and files left on the disk tier.",
        "",
        "| engine | tensors alive after round 1 / last (MiB) | VmRSS after round 1 / last (MiB) "
        "| disk files after last |",
        "| --- | ---: | ---: | ---: |",
    ]
    last = args.rounds - 1
    for engine, per_rank in results.items():
        lines.append(
            f"| {engine} | {worst(per_rank, 'tensor_mib', 0):,.0f} / "
            f"{worst(per_rank, 'tensor_mib', last):,.0f} | {worst(per_rank, 'rss_mib', 0):,.0f} "
            f"/ {worst(per_rank, 'rss_mib', last):,.0f} | "
            f"{worst(per_rank, 'disk_files', last):.0f} |"
        )
    _write_block(path, "bench_lifecycle", lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--size", default="117m", help=f"one of {sorted(SIZES)} or L<layers>x<width>"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--chunk-mib", type=float, default=64.0)
    parser.add_argument("--results", help="write the table into this results file")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    disk = Path(tempfile.mkdtemp(prefix=f"shardwise-lifecycle-{dist.get_rank()}-"))
    os.environ["SHARDWISE_BENCH_DISK_DIR"] = str(disk)
    results: dict[str, list[list[dict[str, Any]]]] = {}
    # What this process held before any engine (a parent's tensors, when forked from one).
    gc.collect()
    baseline_mib = live_tensor_mib()
    for engine in args.engines.split(","):
        mine = measure(engine, args, disk, baseline_mib)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results[engine] = gathered
        if dist.get_rank() == 0:
            rounds = ", ".join(f"{r['tensor_mib']:.1f}" for r in mine)
            print(f"{engine}: tensor MiB alive after each round: {rounds}", flush=True)
    if dist.get_rank() == 0 and args.results:
        write_results(results, args, Path(args.results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
