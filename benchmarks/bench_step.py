"""One engine's training step on every rank torchrun starts; rank 0 writes a JSON summary.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_step.py --engine zero3 --out r.json

Engines: ddp (torch DistributedDataParallel), fsdp2 (torch fully_shard per block and root),
zero1, zero2, zero3 (shardwise; zero3 also with --placement cpu). Same model, seed and global
batch for all, fp32 compute, AdamW (fused) everywhere.
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
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import GPT, GPTConfig, gpt_batch

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--engine", required=True, choices=["ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3"]
    )
    parser.add_argument("--telemetry", action="store_true", help="stream telemetry to a file")
    parser.add_argument(
        "--param-gather", action="store_true",
        help="stages 1-2: overlap the all-gather of updated parameters with the next forward",
    )  # fmt: skip
    parser.add_argument(
        "--reduction", default="auto",
        choices=["auto", "reduce_scatter", "all_to_all", "all_reduce"],
        help="shardwise's gradient_reduction",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="share of time in shardwise code")
    parser.add_argument("--placement", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--chunk-mib", type=float, default=8.0, help="chunk / bucket size")
    return parser.parse_args()


# Engine-name suffixes of the gradient_reduction methods ("auto" is all-to-all on gloo).
REDUCTION_SUFFIX = {"auto": "", "reduce_scatter": "-rs", "all_to_all": "-a2a", "all_reduce": "-ar"}


def torch_step(module: torch.nn.Module) -> Step:
    """A plain torch training step over `module` (DDP or FSDP wrapped), fused AdamW."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, fused=True)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        _, loss = module(idx, targets)
        loss.backward()
        optimizer.step()
        loss_value: torch.Tensor = loss
        return loss_value

    return step


def build(args: argparse.Namespace, model: GPT) -> tuple[Step, Callable[[], dict[str, int]]]:
    """The engine's step function, and a function returning its counters after a step."""
    world = dist.get_world_size()
    if args.engine == "ddp":
        return torch_step(torch.nn.parallel.DistributedDataParallel(model)), dict
    if args.engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from shardwise.testing.gpt import Block

        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
        )
        return torch_step(wrapped), dict
    if args.engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return torch_step(model), dict
    stage = int(args.engine[-1])
    chunk_numel = int(args.chunk_mib * 2**20 / 4)
    config: dict[str, object] = {
        "device": torch.device("cpu"),
        "gradient_reduction": args.reduction,
    }
    if stage == 3:
        config.update(chunk_size_numel=chunk_numel, placement_policy=args.placement)
    wrapped = zero_model_wrapper(model, stage, config)
    zero_optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        optim_config=(
            {"reduce_bucket_size": chunk_numel, "overlap_param_gather": args.param_gather}
            if stage < 3
            else None
        ),
    )

    recorder = None
    if args.telemetry:
        from shardwise import telemetry

        scratch = tempfile.mkdtemp(prefix="shardwise-telemetry-")
        recorder = telemetry.enable(
            wrapped, zero_optimizer, path=f"{scratch}/events", run_id="bench"
        )

    def zero_step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        zero_optimizer.zero_grad()
        _, loss = wrapped(idx, targets)
        zero_optimizer.backward(loss)
        zero_optimizer.step()
        return loss

    def counters() -> dict[str, float]:
        return {
            "sent_bytes": wrapped.comm_stats.sent_bytes(),
            "model_state_bytes": sum(wrapped.memory_report().values())
            + zero_optimizer.state_bytes(),
            "telemetry_cpu_s": recorder.cpu_seconds() if args.telemetry and recorder else 0.0,
        }

    return zero_step, counters


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
    config = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_embd=args.n_embd
    )
    model = GPT(config)
    num_params = model.num_parameters()
    step, counters = build(args, model)
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
            "engine": args.engine
            + ("-" + args.placement if args.engine == "zero3" else "")
            + ("+telemetry" if args.telemetry else "")
            + ("+pg" if args.param_gather else "")
            + REDUCTION_SUFFIX[args.reduction],
            "world": world,
            "params": num_params,
            "median_ms": statistics.median(times),
            "step_ms": times,
            "final_loss": float(loss),
            "sent_bytes_per_step": statistics.median(sent) if sent and sent[0] else None,
            "model_state_bytes": counters().get("model_state_bytes"),
            "peak_rss_mib": peak_kib / 1024,
            "telemetry": args.telemetry,
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
