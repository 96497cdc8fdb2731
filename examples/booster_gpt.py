"""Train a small GPT with the Booster, written as a ColossalAI 0.5 script is, with `shardwise`
for `colossalai` in its imports.

    torchrun --standalone --nproc-per-node=2 examples/booster_gpt.py --plugin gemini [--steps 30]
        [--save-dir ckpt] [--load-dir ckpt]

Plugins: "gemini" (ZeRO-3, chunks placed by the static policy), "low_level_zero" (ZeRO-2),
"torch_ddp". Parameters are stored and communicated in bf16 with fp32 master weights (a CPU
computes in fp32); gradients are clipped to norm 1.0 and accumulated over two micro-batches
with `booster.no_sync`. Rank 0 prints the loss every --log-every steps and at the end.
With --save-dir the model (a sharded Hugging Face-layout directory), the optimizer and the LR
scheduler are saved at the end as ColossalAI's examples save them; --load-dir resumes from
such a directory, written by any plugin at any world size.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import TensorDataset

import shardwise
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from shardwise.cluster import DistCoordinator
from shardwise.nn.optimizer import HybridAdam
from shardwise.testing import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)
ACCUMULATION = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--plugin", choices=["gemini", "low_level_zero", "torch_ddp"], default="gemini"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--batch-size", type=int, default=4, help="sequences per rank per micro-batch"
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--save-dir", help="save model, optimizer and scheduler here at the end")
    parser.add_argument("--load-dir", help="resume from a --save-dir of an earlier run")
    return parser.parse_args()


def synthetic_dataset(samples: int) -> TensorDataset:
    """Sequences that count up from a random start: a pattern a small GPT learns quickly."""
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, CONFIG.vocab_size, (samples, 1), generator=generator)
    tokens = (starts + torch.arange(CONFIG.block_size + 1)) % CONFIG.vocab_size
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main() -> None:
    args = parse_args()
    shardwise.launch_from_torch(seed=42)
    coordinator = DistCoordinator()
    if args.plugin == "gemini":
        plugin = GeminiPlugin(placement_policy="static", precision="bf16", max_norm=1.0)
    elif args.plugin == "low_level_zero":
        plugin = LowLevelZeroPlugin(stage=2, precision="bf16", max_norm=1.0)
    else:
        plugin = TorchDDPPlugin()
    booster = Booster(plugin=plugin)

    dataset = synthetic_dataset(
        args.steps * ACCUMULATION * args.batch_size * coordinator.world_size
    )
    dataloader = plugin.prepare_dataloader(
        dataset, batch_size=args.batch_size, shuffle=True, drop_last=True
    )
    model = GPT(CONFIG)
    optimizer = HybridAdam(model.parameters(), lr=args.lr, weight_decay=0.01)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    model, optimizer, _, dataloader, lr_scheduler = booster.boost(
        model, optimizer, dataloader=dataloader, lr_scheduler=lr_scheduler
    )

    if args.load_dir:
        booster.load_model(model, os.path.join(args.load_dir, "model"))
        booster.load_optimizer(optimizer, os.path.join(args.load_dir, "optimizer"))
        booster.load_lr_scheduler(lr_scheduler, os.path.join(args.load_dir, "lr_scheduler"))
        coordinator.print_on_master(f"resumed from {args.load_dir}")

    batches = iter(dataloader)
    first = last = None
    for step in range(args.steps):
        optimizer.zero_grad()
        step_loss = 0.0
        for micro in range(ACCUMULATION):
            idx, targets = next(batches)
            _, loss = model(idx, targets)
            loss = loss / ACCUMULATION
            if micro < ACCUMULATION - 1:
                with booster.no_sync(model, optimizer):
                    booster.backward(loss, optimizer)
            else:
                booster.backward(loss, optimizer)
            step_loss += float(loss.detach())
        if args.plugin == "torch_ddp":
            optimizer.clip_grad_by_norm(1.0)
        optimizer.step()
        lr_scheduler.step()
        first = step_loss if first is None else first
        last = step_loss
        if step % args.log_every == 0 or step == args.steps - 1:
            coordinator.print_on_master(
                f"step {step:4d} | loss {step_loss:.4f} | lr {lr_scheduler.get_last_lr()[0]:.2e}"
            )
    coordinator.print_on_master(f"first loss {first:.4f}, last loss {last:.4f}")
    if args.save_dir:
        booster.save_model(model, os.path.join(args.save_dir, "model"), shard=True)
        booster.save_optimizer(optimizer, os.path.join(args.save_dir, "optimizer"), shard=True)
        booster.save_lr_scheduler(lr_scheduler, os.path.join(args.save_dir, "lr_scheduler"))
        coordinator.print_on_master(f"saved to {args.save_dir}")


if __name__ == "__main__":
    main()
