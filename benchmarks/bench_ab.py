"""Step times of several engines taken in one process group, interleaved step block by block.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_ab.py \\
        --engines ddp,zero2,zero2+sync --out r.json

Each engine trains its own copy of the same model (same seed, same batches). After a warm-up
of every engine, round after round each engine runs `--block` steps in turn, the order rotating
every round; the first step of each turn is left out of the figures (it pays for the cache the
previous engine evicted). By default (`--timing loop`) a turn runs as a training loop does,
steps back to back without barriers between them, and is timed from its first step's return to
a barrier after its last: collectives a step leaves running overlap the next step, as in
training, and are paid inside the turn; one figure per turn, ms per step. `--timing turn`
times each step from a barrier before it to its return: what a step leaves running (stages
1-2's deferred parameter gathers) then finishes in the untimed barrier before the next step
and is not counted. `--timing outside` times as a user's script does from outside
instead: every step counted (none left out, no warm-up unless asked), each from a barrier to
a barrier after the step, so a rank waiting for the other counts, and so do collectives a step
leaves running on the group (the barrier queues behind them). Every step's time is written
with its round, its place in the turn and the part spent in the barrier after it, so the two
ways can be compared on one run. Separate runs of one engine drift by several percent on these
machines; figures interleaved this finely share the drift, so their ratios hold. Rank 0 writes
per-engine medians and every measured step time. Every engine must reach the same losses: the
final loss of each is reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from engines import EngineSpec, add_model_arguments, build, model_config

from shardwise.testing import GPT, gpt_batch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", required=True, help="comma-separated engine names")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=3, help="steps per engine per turn")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--timing",
        choices=("loop", "turn", "outside"),
        default="loop",
        help="turn: leave out each turn's first step; outside: every step, barrier to barrier; "
        "loop: a turn's steps back to back, timed after its first",
    )
    add_model_arguments(parser)
    args = parser.parse_args()
    if args.block < 2 and args.timing in ("turn", "loop"):
        parser.error("--block must be at least 2 (a turn's first step is not measured)")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = model_config(args)
    specs = [EngineSpec.parse(name) for name in args.engines.split(",")]
    num_params = GPT(config).num_parameters()  # before any engine shards its copy
    engines = {}
    for spec in specs:
        torch.manual_seed(0)
        model = GPT(config)
        engines[spec.name] = build(spec, model, args.chunk_mib)
    steps_done = dict.fromkeys(engines, 0)
    times: dict[str, list[float]] = {name: [] for name in engines}
    # Each round's median per engine: ratios round by round show the spread of a ratio.
    round_medians: dict[str, list[float]] = {name: [] for name in engines}
    losses: dict[str, float] = {}

    warmup: dict[str, list[float]] = {name: [] for name in engines}
    # Every measured step as [round, place in its turn, ms, ms of it in the barrier after].
    every_step: dict[str, list[list[float]]] = {name: [] for name in engines}
    outside = args.timing == "outside"

    def run_loop(name: str, count: int) -> None:
        """A turn as a training loop runs it: steps back to back, no barrier between them; the
        clock starts when the first step returns and stops after the barrier behind the last,
        so whatever a step leaves running (deferred gathers) is paid inside the turn, overlapped
        with the next step as it would be in training. One figure per turn: ms per step."""
        step, _ = engines[name]
        dist.barrier()
        start = 0.0
        for turn_step in range(count):
            idx, targets = gpt_batch(config, args.batch, args.seq, steps_done[name])
            loss = step(idx.chunk(world)[rank], targets.chunk(world)[rank])
            if turn_step == 0:
                start = time.perf_counter()
            steps_done[name] += 1
            losses[name] = float(loss.detach())
        dist.barrier()
        times[name].append((time.perf_counter() - start) * 1000 / (count - 1))

    def run(name: str, count: int, record: bool, round_index: int = -1) -> None:
        if record and args.timing == "loop":
            run_loop(name, count)
            return
        step, _ = engines[name]
        for turn_step in range(count):
            idx, targets = gpt_batch(config, args.batch, args.seq, steps_done[name])
            dist.barrier()
            start = time.perf_counter()
            loss = step(idx.chunk(world)[rank], targets.chunk(world)[rank])
            returned = time.perf_counter()
            if outside:
                dist.barrier()
            elapsed = (time.perf_counter() - start) * 1000
            # What the barrier after the step waited for: the other rank, and the collectives
            # the step left running on the group (stages 1-2's deferred parameter gathers).
            tail = elapsed - (returned - start) * 1000
            steps_done[name] += 1
            losses[name] = float(loss.detach())
            if record:
                every_step[name].append([round_index, turn_step, elapsed, tail])
            if record and (turn_step > 0 or outside):
                times[name].append(elapsed)
            if not record:
                warmup[name].append(elapsed)

    for name in engines:
        run(name, args.warmup, record=False)
    names = list(engines)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            before = len(times[name])
            run(name, args.block, record=True, round_index=round_index)
            round_medians[name].append(statistics.median(times[name][before:]))
        if rank == 0:
            medians = ", ".join(f"{n} {statistics.median(times[n]):.1f}" for n in names)
            print(f"round {round_index + 1}/{args.rounds}: {medians}", flush=True)
    # The engines' counters: bytes sent and moved between pools (to and from the disk tier
    # too) per step over every step they ran; the others as they stand.
    per_step = {
        name: {
            k: v / steps_done[name] if k.startswith(("moved_", "sent_")) else v
            for k, v in engines[name][1]().items()
        }
        for name in names
    }
    if rank == 0:
        summary = {
            "world": world,
            "params": num_params,
            "steps_per_engine": steps_done[names[0]],
            "timing": args.timing,
            "engines": {
                name: {
                    "median_ms": statistics.median(times[name]),
                    "step_ms": times[name],
                    "every_step": every_step[name],
                    "round_median_ms": round_medians[name],
                    "final_loss": losses[name],
                    # The warm-up steps, first to last: a compiled engine's first step
                    # compiles (alone in its process, as bench_compile_time.py runs it).
                    "warmup_ms": warmup[name],
                    "counters_per_step": per_step[name],
                }
                for name in names
            },
        }
        with open(args.out, "w") as handle:
            json.dump(summary, handle, indent=1)
    # Drop the engines (DDP's reducer may hold the group) and synchronise before teardown.
    engines.clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
