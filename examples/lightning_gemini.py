"""Train a small GPT with PyTorch Lightning and the shardwise Gemini strategy (ZeRO stage 3).

    torchrun --standalone --nproc-per-node=2 examples/lightning_gemini.py [--steps 40]
    python examples/lightning_gemini.py --devices 2    # Lightning starts the second process

`import shardwise_lightning` registers the strategy names; `Trainer(strategy="shardwise_gemini")`
then shards parameters, gradients and optimizer state over the ranks torchrun starts. The model
is built in `configure_model`, so no rank ever holds it whole; bf16 payloads with fp32 math and
fp32 master weights (`precision="bf16-mixed"`). Rank 0 prints one line per step.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import shardwise_lightning  # noqa: F401  (registers "shardwise_gemini" and the others)
from shardwise import HybridAdam
from shardwise.testing import GPT, GPTConfig, gpt_batch


class RandomTokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """`steps` global batches of tokens whose next token follows a fixed rule."""

    def __init__(self, config: GPTConfig, steps: int, batch: int, seq: int) -> None:
        self.samples = [
            pair
            for step in range(steps)
            for pair in zip(*gpt_batch(config, batch, seq, step), strict=True)
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.samples[index]


class LitGPT(pl.LightningModule):
    def __init__(self, config: GPTConfig, lr: float) -> None:
        super().__init__()
        self.config = config
        self.lr = lr
        self.gpt: GPT | None = None

    def configure_model(self) -> None:
        if self.gpt is None:  # built inside the strategy's sharded context: sliced at creation
            self.gpt = GPT(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        assert self.gpt is not None
        logits, _ = self.gpt(idx)
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.is_global_zero:
            loss = float(self.trainer.callback_metrics["loss"])
            print(f"step {self.trainer.global_step:3d} | loss {loss:.4f}", flush=True)

    def configure_optimizers(self) -> Any:
        return HybridAdam(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split over ranks")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")), help="ranks"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = args.devices
    if args.batch % world:
        parser.error(f"--batch {args.batch} must be a multiple of the {world} ranks")
    config = GPTConfig(vocab_size=128, block_size=args.seq, n_layer=2, n_head=2, n_embd=64)
    pl.seed_everything(0, verbose=False)
    data = DataLoader(
        RandomTokens(config, args.steps, args.batch, args.seq), batch_size=args.batch // world
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's hints about workers and loggers
        trainer = pl.Trainer(
            strategy="shardwise_gemini",
            accelerator="cpu",
            devices=world,
            precision="bf16-mixed",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(LitGPT(config, args.lr), data)
    if trainer.is_global_zero:
        print(
            f"trained {trainer.global_step} steps with {type(trainer.strategy).__name__} "
            f"on {world} ranks"
        )


if __name__ == "__main__":
    main()
