"""Time one training step of a single engine on every rank torchrun starts.

    torchrun --standalone --nproc-per-node=2 benchmarks/step_bench.py --engine zero2 --out r.json

Engines: ``ddp`` (torch DistributedDataParallel), ``fsdp2`` (torch ``fully_shard`` on each
transformer block and on the root), ``zero2`` and ``zero3`` (shardwise). Every engine trains the
same GPT from the same seed on the same global batch, fp32, with fused AdamW, so step times and
losses are comparable. Rank 0 writes a JSON summary to ``--out``; ``benchmarks/run.py`` drives
all engines and renders ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import GPT, GPTConfig, gpt_batch

ENGINES = ("ddp", "fsdp2", "zero2", "zero3")

# 4 Mi elements (16 MiB of fp32) per gradient bucket / chunk: the whole default model fits in
# two, so shardwise issues few, large collectives, as DDP's and FSDP2's defaults roughly do.
BUCKET_NUMEL = 4 * 1024 * 1024


@dataclass
class Engine:
    """A wrapped model's training step and the shardwise counters it exposes, if any."""

    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Runs forward, backward and the optimizer step on one batch; returns the loss."""
    sent_bytes: Callable[[], int] | None = None
    """Bytes this rank has sent in collectives so far (shardwise engines only)."""
    state: Callable[[], dict[str, int]] = field(default=dict)
    """Model-state bytes this rank holds, by kind (shardwise engines only)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; model shape defaults are the benchmark's reference model."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--engine", required=True, choices=ENGINES)
    parser.add_argument("--out", required=True, type=Path, help="JSON summary (rank 0 writes)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split over ranks")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    return parser.parse_args(argv)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def _plain_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The ordinary torch step, shared by DDP and FSDP2 (their hooks do the communication)."""

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def build_engine(name: str, gpt: GPT) -> Engine:
    """Wrap `gpt` for engine `name` and return its step function and counters."""
    if name == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(gpt)
        return Engine(_plain_step(ddp, _adamw(ddp.parameters())))
    if name == "fsdp2":
        # Imported here so the other engines do not pay for (or depend on) FSDP's import.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in gpt.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(gpt, mesh=mesh)
        return Engine(_plain_step(gpt, _adamw(gpt.parameters())))
    if name == "zero2":
        model = zero_model_wrapper(gpt, zero_stage=2, gemini_config={"device": torch.device("cpu")})
        optimizer = zero_optim_wrapper(
            model,
            _adamw(model.parameters()),
            optim_config={"reduce_bucket_size": BUCKET_NUMEL},
        )
    elif name == "zero3":
        model = zero_model_wrapper(
            gpt,
            zero_stage=3,
            gemini_config={"device": torch.device("cpu"), "chunk_size_numel": BUCKET_NUMEL},
        )
        optimizer = zero_optim_wrapper(model, _adamw(model.parameters()))
    else:
        raise ValueError(f"unknown engine {name!r}; choose from {ENGINES}")

    def zero_step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        _, loss = model(idx, targets)
        optimizer.backward(loss)
        optimizer.step()
        return loss.detach()

    def state() -> dict[str, int]:
        report = dict(model.memory_report())
        report["optimizer_state"] = optimizer.state_bytes()
        return report

    return Engine(zero_step, model.comm_stats.sent_bytes, state)


def main(argv: list[str] | None = None) -> None:
    """Build the model, wrap it, run warmup + measured steps, and write rank 0's summary."""
    args = parse_args(argv)
    # One intra-op thread per rank: two ranks on two cores, so neither oversubscribes.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} does not split evenly over {world} ranks")
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.n_layer,
        n_head=4,
        n_embd=args.n_embd,
        tie_weights=True,
    )
    gpt = GPT(config)
    # Counted before wrapping: FSDP2 replaces parameters with local shards.
    params = gpt.num_parameters()
    engine = build_engine(args.engine, gpt)

    step_ms: list[float] = []
    sent_per_step: list[int] = []
    loss = torch.zeros(())
    for i in range(args.warmup + args.steps):
        idx, targets = gpt_batch(config, args.batch, args.seq, i)
        idx, targets = idx.chunk(world)[rank], targets.chunk(world)[rank]
        sent_before = engine.sent_bytes() if engine.sent_bytes else 0
        # Start every rank's clock together, so one rank's lag is not charged to the step.
        dist.barrier()
        start = time.perf_counter()
        loss = engine.step(idx, targets)
        elapsed_ms = (time.perf_counter() - start) * 1000
        if i >= args.warmup:
            step_ms.append(elapsed_ms)
            if engine.sent_bytes:
                sent_per_step.append(engine.sent_bytes() - sent_before)

    # Each rank's loss covers its slice of the batch; the mean is the global batch's loss.
    # (Summed then divided: gloo has no AVG reduction.)
    loss = loss.clone()
    dist.all_reduce(loss)
    loss /= world
    state = engine.state()
    if rank == 0:
        summary = {
            "engine": args.engine,
            "world": world,
            "params": params,
            "median_ms": statistics.median(step_ms),
            "step_ms": step_ms,
            "loss": float(loss),  # the last step's loss over the global batch
            "bytes_sent_per_step": statistics.median_high(sent_per_step) if sent_per_step else None,
            "model_state": state or None,
            "model_state_bytes": sum(state.values()) if state else None,
        }
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
