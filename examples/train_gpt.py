"""Train a small GPT with ZeRO stage 3 on every rank torchrun starts.

    torchrun --standalone --nproc-per-node=2 examples/train_gpt.py [--steps 300]

Parameters are stored and communicated in fp16 (computed in fp32, which is what a CPU does
fast), the optimizer steps sharded fp32 master weights, and a dynamic loss scale guards the
fp16 gradients. Rank 0 shows a progress bar and one line per step.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from shardwise import MixedPrecision, telemetry, zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import GPT, GPTConfig, gpt_batch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split over ranks")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=64 * 1024, help="elements per chunk")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    if args.steps < 1 or args.batch < 1:
        parser.error(f"--steps and --batch must be >= 1, got {args.steps} and {args.batch}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must divide evenly over {world} ranks")

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_embd=args.n_embd
    )
    model = GPT(config)
    num_params = model.num_parameters()
    model = zero_model_wrapper(
        model,
        zero_stage=3,
        gemini_config={
            "device": torch.device("cpu"),
            "placement_policy": "cuda",  # keep every chunk on the compute device (here: CPU)
            "chunk_size_numel": args.chunk_size,
            "mixed_precision": MixedPrecision(
                param_dtype=torch.float16, compute_dtype=torch.float32
            ),
        },
    )
    optimizer = zero_optim_wrapper(
        model,
        torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True),
        initial_scale=2**16,
        growth_interval=50,
        max_norm=1.0,
    )
    # Streams to a dashboard when SHARDWISE_DASHBOARD_URL is set (or to files with
    # SHARDWISE_TELEMETRY_FILE); otherwise does nothing.
    recorder = telemetry.enable(model, optimizer)
    if rank == 0:
        chunks = len(model.chunk_manager.chunks)
        print(f"GPT, {num_params:,} parameters in {chunks} chunks, ZeRO stage 3 on {world} ranks")
        if recorder is not None:
            where = os.environ.get("SHARDWISE_DASHBOARD_URL") or "JSON-lines files"
            print(f"telemetry of run {recorder.emitter.run_id} streams to {where}")

    progress = tqdm(range(args.steps), disable=rank != 0, unit="step", dynamic_ncols=True)
    for step in progress:
        start = time.perf_counter()
        sent_before = model.comm_stats.sent_bytes()
        idx, targets = gpt_batch(config, args.batch, args.seq, step)
        optimizer.zero_grad()
        _, loss = model(idx.chunk(world)[rank], targets.chunk(world)[rank])
        optimizer.backward(loss)
        stepped = optimizer.step()
        step_ms = (time.perf_counter() - start) * 1000
        sent = model.comm_stats.sent_bytes() - sent_before
        state_bytes = sum(model.memory_report().values()) + optimizer.state_bytes()
        if rank == 0:
            progress.write(
                f"step {step:4d} | loss {loss.item():.4f} | scale {optimizer.loss_scale:>9.0f}"
                f"{'' if stepped else ' (overflow: skipped)'} | grad norm "
                f"{optimizer.last_grad_norm:.3f} | {step_ms:6.1f} ms | sent {sent / 2**20:.2f} MiB"
                f" | model state {state_bytes / 2**20:.2f} MiB/rank"
            )
    if recorder is not None:
        recorder.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
