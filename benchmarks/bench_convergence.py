"""Training with quantized communication against the same run without it, to convergence.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_convergence.py \\
        --formats dtype/dtype,int8/int8,fp8/fp8 --steps 1000 --out conv.json --plot conv.png

Each run trains one model from the same seed on the same batches at ZeRO stage 3, with the
parameter gather format and the gradient reduce format named `GATHER/REDUCE` (see README,
"Quantized communication"; `dtype/dtype` is the unquantized engine), one run after the other in
one process group. The data is the demo's text (examples/data/shakespeare.txt, byte by byte,
its last tenth held out for evaluation); the models are the demo's GPT (`--model gpt`: 4
layers, width 128, fp16 storage and communication, fp32 compute, fused AdamW, dynamic loss
scaling, gradient clipping at 1.0, as examples/train_gpt.py trains it) or transformers' Llama
built from a config (`--model llama`: 4 layers, width 128, fp32). The evaluation loss over the
same held-out batches is taken every `--eval-every` steps and at the end; rank 0 writes every
run's curves, final evaluation loss, bytes sent per step and the relative gap of the final loss
to the first run's, and with `--plot` draws the curves (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import GPT, GPTConfig

# The demo's data and batches, so these runs train on exactly what the demo trains on.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import TEXT, VOCAB, load_text, text_batch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="dtype/dtype,int8/int8,fp8/fp8")
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split over ranks")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=128 * 1024, help="elements per chunk")
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot", help="a PNG of the curves (rank 0)")
    args = parser.parse_args()
    if args.steps < 1 or args.eval_every < 1 or args.eval_batches < 1 or args.batch < 1:
        parser.error("--steps, --eval-every, --eval-batches and --batch must be >= 1")
    for pair in args.formats.split(","):
        if pair.count("/") != 1:
            parser.error(f"--formats takes GATHER/REDUCE pairs, got {pair!r}")
    return args


def build_model(kind: str, seq: int) -> tuple[torch.nn.Module, MixedPrecision | None]:
    if kind == "gpt":
        config = GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=4, n_embd=128)
        fp16 = MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32)
        return GPT(config), fp16
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=seq,
    )
    return LlamaForCausalLM(config), None


def loss_of(kind: str, model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> Any:
    if kind == "gpt":
        return model(idx, targets)[1]
    # transformers shifts the labels itself: the whole window as input and labels predicts
    # the same next bytes as the GPT's (idx, targets).
    window = torch.cat([idx, targets[:, -1:]], dim=1)
    return model(input_ids=window, labels=window).loss


def train(args: argparse.Namespace, gather: str, reduce: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    train_data, held_out = load_text(TEXT)
    torch.manual_seed(0)
    model, precision = build_model(args.model, args.seq + (1 if args.model == "llama" else 0))
    gemini_config: dict[str, Any] = {
        "device": torch.device("cpu"),
        "chunk_size_numel": args.chunk_size,
        "gather_format": gather,
        "reduce_format": reduce,
    }
    if precision is not None:
        gemini_config["mixed_precision"] = precision
    wrapped = zero_model_wrapper(model, zero_stage=3, gemini_config=gemini_config)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True),
        **({"initial_scale": 2**16, "growth_interval": 50} if precision is not None else {}),
        max_norm=1.0,
    )

    def evaluate() -> float:
        generator = torch.Generator().manual_seed(1234)
        total = torch.zeros(())
        wrapped.eval()
        with torch.no_grad():
            for _ in range(args.eval_batches):
                idx, targets = text_batch(held_out, args.batch, args.seq, generator)
                mine = idx.chunk(world)[rank], targets.chunk(world)[rank]
                total += loss_of(args.model, wrapped, *mine).float()
        wrapped.train()
        dist.all_reduce(total)
        return float(total) / (args.eval_batches * world)

    generator = torch.Generator().manual_seed(0)
    train_losses, evals = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        idx, targets = text_batch(train_data, args.batch, args.seq, generator)
        optimizer.zero_grad()
        loss = loss_of(args.model, wrapped, idx.chunk(world)[rank], targets.chunk(world)[rank])
        optimizer.backward(loss)
        optimizer.step()
        train_losses.append(float(loss.detach()))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evals.append([step + 1, evaluate()])
            if rank == 0:
                print(f"{gather}/{reduce} step {step + 1}: eval {evals[-1][1]:.4f}", flush=True)
    seconds = time.perf_counter() - start
    sent = wrapped.comm_stats.sent_bytes() / args.steps
    optimizer.close()
    return {
        "train_loss": train_losses,
        "eval_loss": evals,
        "final_eval_loss": evals[-1][1],
        "sent_bytes_per_step": sent,
        "seconds": seconds,
    }


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in summary["runs"].items():
        losses = torch.tensor(run["train_loss"])
        window = 25
        smooth = losses.unfold(0, window, 1).mean(1) if len(losses) >= window else losses
        axes[0].plot(range(len(losses) - len(smooth) + 1, len(losses) + 1), smooth, label=name)
        steps, evals = zip(*run["eval_loss"], strict=True)
        axes[1].plot(steps, evals, label=name, marker=".")
    axes[0].set_title(f"train loss ({summary['model']}, mean of 25 steps)")
    axes[1].set_title("held-out loss")
    for axis in axes:
        axis.set_xlabel("step")
        axis.legend(title="gather/reduce")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    runs = {}
    for pair in args.formats.split(","):
        gather, reduce = pair.split("/")
        runs[pair] = train(args, gather, reduce)
    if dist.get_rank() == 0:
        first = next(iter(runs.values()))
        for run in runs.values():
            run["final_gap"] = run["final_eval_loss"] / first["final_eval_loss"] - 1
            run["sent_vs_first"] = run["sent_bytes_per_step"] / first["sent_bytes_per_step"]
        summary = {"model": args.model, "steps": args.steps, "world": dist.get_world_size()}
        summary["runs"] = runs
        with open(args.out, "w") as handle:
            json.dump(summary, handle)
        for name, run in runs.items():
            print(
                f"{name}: final eval {run['final_eval_loss']:.4f} "
                f"({run['final_gap']:+.2%}), {run['sent_bytes_per_step']:,.0f} B/step "
                f"({run['sent_vs_first']:.3f}), {run['seconds']:.0f} s"
            )
        if args.plot:
            plot(summary, args.plot)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
