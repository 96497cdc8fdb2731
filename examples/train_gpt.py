"""Train a small character-level GPT on Shakespeare with ZeRO stage 3 and Gemini placement.

    torchrun --standalone --nproc-per-node=2 examples/train_gpt.py [--steps 300]

The text is examples/data/shakespeare.txt (three public-domain plays; see the README there), read
byte by byte; its last 10 % is held out and the evaluation loss on it is printed (and sent to the
dashboard) every --eval-every steps and at the end. Parameters are stored and communicated in fp16
(computed in fp32, which is what a CPU does fast), the optimizer steps sharded fp32 master weights,
and a dynamic loss scale guards the fp16 gradients. The "auto" placement policy decides where each
chunk lives against a device budget smaller than the model state: some chunks keep their shard on
the device, the others live in host memory and move in for every gather, and the optimizer sides
stay in host memory (watch the dashboard's chunk map and placement timeline). Rank 0 shows a
progress bar and one line per step.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from shardwise import MixedPrecision, telemetry, zero_model_wrapper, zero_optim_wrapper
from shardwise.telemetry import events
from shardwise.testing import GPT, GPTConfig

TEXT = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
VOCAB = 256  # one token per byte
HELD_OUT = 0.1  # the text's last tenth is for evaluation only
# The device may hold this share of a rank's model state (fp16 payloads, fp32 masters, gradients,
# Adam moments): below 1, so "auto" must keep some of it in host memory. The activations count
# against the budget too, and they grow with batch x sequence: at the defaults (2 sequences of 32
# bytes per rank) "auto" traces 2.1 MiB of them beside a 1.7 MiB working set (gathered chunks,
# gradient buffers) and keeps 1.3 MiB free for two more gathered chunks, so of the 5.3 MiB budget
# (75% of the 7.1 MiB model state) 0.4 MiB is left for shards: 5 of the 9 chunks keep theirs on
# the device, 4 in host memory, and every optimizer side stays in host memory (2.0 MiB moved per
# step). Measured: from about 0.70 to 0.82 some shards stay and some move; 0.85 keeps all 9, below
# 0.70 none. At 4 x 64 bytes per rank (--batch 8 --seq 64) the activations alone (8.3 MiB) pass
# the whole model state: no budget below it keeps a shard on the device.
DEVICE_BUDGET_SHARE = 0.75
# fp16 payload + fp32 master + fp32 gradient + two fp32 Adam moments, per parameter.
STATE_BYTES_PER_PARAM = 2 + 4 + 4 + 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=250)
    # Small batch and sequence: the activations count against the device budget (see
    # DEVICE_BUDGET_SHARE). 16 evaluation batches of them are 2,048 held-out bytes.
    parser.add_argument("--batch", type=int, default=4, help="global batch, split over ranks")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=128 * 1024, help="elements per chunk")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    parser.add_argument(
        "--eval-batches", type=int, default=16, help="held-out batches per evaluation"
    )
    parser.add_argument(
        "--placement", default="auto", help='"auto" (default), "cuda"/"device", "cpu", "static"'
    )
    parser.add_argument(
        "--budget-share",
        type=float,
        default=DEVICE_BUDGET_SHARE,
        help="device budget as a share of the model state per rank (placement auto)",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.batch < 1 or args.eval_every < 1 or args.eval_batches < 1:
        parser.error(
            "--steps, --batch, --eval-every and --eval-batches must be >= 1, got "
            f"{args.steps}, {args.batch}, {args.eval_every} and {args.eval_batches}"
        )
    if not args.budget_share > 0:  # also refuses nan
        parser.error(f"--budget-share must be > 0, got {args.budget_share}")
    return args


def load_text(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The text as byte ids, split into (train, held-out)."""
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    split = int(len(data) * (1 - HELD_OUT))
    return data[:split], data[split:]


def text_batch(
    data: torch.Tensor, batch: int, seq: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` windows at random offsets: (idx, targets), each (batch, seq), targets shifted by
    one byte. Every rank draws the same global batch from the same generator state."""
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
    windows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])  # (B, T+1)
    return windows[:, :-1], windows[:, 1:]


def evaluate(
    model: torch.nn.Module, held_out: torch.Tensor, args: argparse.Namespace, rank: int, world: int
) -> float:
    """Mean loss over the same held-out batches on every run. At stage 3 every rank must run
    the same forward passes (their gathers pair up), so each evaluates its share of each batch
    and an all-reduce averages the losses."""
    generator = torch.Generator().manual_seed(1234)
    total = torch.zeros(())
    model.eval()
    with torch.no_grad():
        for _ in range(args.eval_batches):
            idx, targets = text_batch(held_out, args.batch, args.seq, generator)
            _, loss = model(idx.chunk(world)[rank], targets.chunk(world)[rank])
            total += loss.float()
    model.train()
    dist.all_reduce(total)
    return float(total) / (args.eval_batches * world)


def sample_placement_during_backward(
    model: torch.nn.Module, recorder: telemetry.TelemetryRecorder, step_now: list[int]
) -> None:
    """Send a chunk snapshot once per step from inside backward, at block `step % n_layer`.

    At a step's end the "auto" policy has sent every shard it brought in back to its pool, so
    end-of-step snapshots all look alike. Taken while backward runs, at a block that rotates
    with the step, they catch the chunks that block needs gathered and show, step after step,
    the gathers sweeping through the model: the dashboard's chunk map and placement timeline
    then move as the chunks do."""
    blocks = model.module.blocks  # the GPT inside GeminiDDP

    def snapshot(index: int) -> None:
        step = step_now[0]
        if step == 0 or step % len(blocks) != index:
            return  # step 0: the recorder's own snapshot, after the warm-up step
        report = model.chunk_manager.report()
        emitter = recorder.emitter
        emitter.emit(events.chunks(emitter.run_id, emitter.rank, step_index=step, report=report))

    for index, block in enumerate(blocks):
        block.register_full_backward_pre_hook(lambda *_, index=index: snapshot(index))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must divide evenly over {world} ranks")
    train_data, held_out = load_text(TEXT)

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB, block_size=args.seq, n_layer=args.n_layer, n_embd=args.n_embd
    )
    model = GPT(config)
    num_params = model.num_parameters()
    state_bytes = num_params * STATE_BYTES_PER_PARAM // world
    gemini_config = {
        "device": torch.device("cpu"),
        "placement_policy": args.placement,
        "chunk_size_numel": args.chunk_size,
        "mixed_precision": MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32),
    }
    if args.placement == "auto":
        gemini_config["device_budget_bytes"] = int(state_bytes * args.budget_share)
    model = zero_model_wrapper(model, zero_stage=3, gemini_config=gemini_config)
    optimizer = zero_optim_wrapper(
        model,
        torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True),
        initial_scale=2**16,
        growth_interval=50,
        max_norm=1.0,
    )
    # Streams to a dashboard when SHARDWISE_DASHBOARD_URL is set (or to files with
    # SHARDWISE_TELEMETRY_FILE), rank 0 printing the run's id and its page; otherwise does
    # nothing. The recorder's own chunk snapshot comes at the end of step 0 only: the others
    # are taken during backward (see below).
    recorder = telemetry.enable(model, optimizer, chunk_every=args.steps + 1)
    step_now = [0]
    if recorder is not None:
        sample_placement_during_backward(model, recorder, step_now)
    if rank == 0:
        chunks = len(model.chunk_manager.chunks)
        print(
            f"GPT, {num_params:,} parameters in {chunks} chunks, ZeRO stage 3 on {world} ranks; "
            f"text {TEXT.name}: {len(train_data):,} bytes to train on, {len(held_out):,} held out"
        )
        budget = gemini_config.get("device_budget_bytes")
        if budget is not None:
            print(
                f'placement "{args.placement}": device budget {budget / 2**20:.2f} MiB per rank, '
                f"{args.budget_share:.0%} of the {state_bytes / 2**20:.2f} MiB model state"
            )

    generator = torch.Generator().manual_seed(0)
    gemini = model.gemini_manager
    progress = tqdm(range(args.steps), disable=rank != 0, unit="step", dynamic_ncols=True)
    for step in progress:
        step_now[0] = step
        start = time.perf_counter()
        sent_before = model.comm_stats.sent_bytes()
        moved_before = sum(gemini.bytes_moved().values()) if gemini is not None else 0
        idx, targets = text_batch(train_data, args.batch, args.seq, generator)
        optimizer.zero_grad()
        _, loss = model(idx.chunk(world)[rank], targets.chunk(world)[rank])
        optimizer.backward(loss)
        stepped = optimizer.step()
        step_ms = (time.perf_counter() - start) * 1000
        sent = model.comm_stats.sent_bytes() - sent_before
        moved = (sum(gemini.bytes_moved().values()) if gemini is not None else 0) - moved_before
        last = step == args.steps - 1
        eval_loss = (
            evaluate(model, held_out, args, rank, world)
            if ((step + 1) % args.eval_every == 0 or last)
            else None
        )
        if eval_loss is not None and recorder is not None:
            # On every rank, as the step events: the all-reduced loss is the same on each.
            recorder.evaluated(step, eval_loss)
        if rank == 0:
            progress.write(
                f"step {step:4d} | loss {loss.item():.4f} | scale {optimizer.loss_scale:>9.0f}"
                f"{'' if stepped else ' (overflow: skipped)'} | grad norm "
                f"{optimizer.last_grad_norm:.3f} | {step_ms:6.1f} ms | sent {sent / 2**20:.2f} MiB"
                f" | moved {moved / 2**20:.2f} MiB"
                + (f" | eval loss {eval_loss:.4f}" if eval_loss is not None else "")
            )
    if recorder is not None:
        recorder.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
