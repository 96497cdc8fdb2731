"""ColossalAI's examples/tutorial/new_api/glue_bert/finetune.py (hpcaitech/ColossalAI), followed
step for step with `shardwise` for `colossalai`: `launch_from_torch(seed=42)`, the plugins and
their arguments (torch_ddp, torch_ddp_fp16 through `Booster(mixed_precision="fp16")`,
`GeminiPlugin(placement_policy="static", strict_ddp_mode=True, initial_scale=2**5)`,
`LowLevelZeroPlugin(initial_scale=2**5)`), BERT for sequence classification, HybridAdam over
the weight-decay and no-decay groups at the learning rate scaled by the world size,
transformers' linear warmup schedule, `booster.boost(model, optimizer, lr_scheduler=...)`, the
training loop and the evaluation's loss all-reduce.

What differs, and why:
- The GLUE MRPC data (`GLUEDataBuilder`, a download) is synthetic sentence pairs whose label
  is whether two token ids agree, tokenised already; the test runs offline. `--num_samples`
  and `--batch_size` make it small (the example: MRPC, batches of 32).
- BERT is built from a tiny `BertConfig` (HF_HUB_OFFLINE; the example loads
  bert-base-uncased's weights).
- `datasets.load_metric("glue", ...)` is gone from `datasets` (and `datasets` is not a
  dependency here): accuracy and F1 are counted by hand, summed over the ranks.
- `move_to_cuda` moves to `get_accelerator().get_current_device()` (the CPU here).
- Each rank prints its step losses as `step <i> loss <l>`, where the example shows them in a
  tqdm bar on rank 0.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

import shardwise
from shardwise.accelerator import get_accelerator
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from shardwise.cluster import DistCoordinator
from shardwise.nn.optimizer import HybridAdam

NUM_EPOCHS = 1
LEARNING_RATE = 2.4e-5
WEIGHT_DECAY = 0.01
WARMUP_FRACTION = 0.1
VOCAB, SEQ = 64, 16


def move_to_cuda(batch):
    device = get_accelerator().get_current_device()
    return {k: v.to(device) for k, v in batch.items()}


class PairDataset(TensorDataset):
    def __getitem__(self, index):
        input_ids, token_type_ids, attention_mask, labels = super().__getitem__(index)
        return {
            "input_ids": input_ids,
            "token_type_ids": token_type_ids,
            "attention_mask": attention_mask,
            "labels": labels,
        }


def synthetic_pairs(num_samples: int, seed: int) -> PairDataset:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, VOCAB, (num_samples, SEQ), generator=generator)
    labels = (input_ids[:, 1] % 2 == input_ids[:, SEQ // 2 + 1] % 2).long()
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, SEQ // 2 :] = 1
    return PairDataset(input_ids, token_type_ids, torch.ones_like(input_ids), labels)


@torch.no_grad()
def evaluate(model: nn.Module, test_dataloader: DataLoader, coordinator: DistCoordinator):
    model.eval()
    device = get_accelerator().get_current_device()
    accum_loss = torch.zeros(1, device=device)
    counts = torch.zeros(
        4, device=device
    )  # true positives, false positives, false negatives, correct
    total = torch.zeros(1, device=device)
    for batch in test_dataloader:
        batch = move_to_cuda(batch)
        outputs = model(**batch)
        val_loss, logits = outputs[:2]
        accum_loss.add_(val_loss)
        preds = torch.argmax(logits, axis=1)
        labels = batch["labels"]
        counts += torch.stack(
            [
                ((preds == 1) & (labels == 1)).sum(),
                ((preds == 1) & (labels == 0)).sum(),
                ((preds == 0) & (labels == 1)).sum(),
                (preds == labels).sum(),
            ]
        ).float()
        total += labels.numel()
    dist.all_reduce(accum_loss.div_(len(test_dataloader)))
    dist.all_reduce(counts)
    dist.all_reduce(total)
    tp, fp, fn, correct = counts.tolist()
    results = {"accuracy": correct / total.item(), "f1": 2 * tp / max(2 * tp + fp + fn, 1)}
    if coordinator.is_master():
        results["loss"] = accum_loss.item() / coordinator.world_size
    return results


def train_epoch(epoch, model, optimizer: Optimizer, lr_scheduler, train_dataloader, booster):
    model.train()
    for step, batch in enumerate(train_dataloader):
        batch = move_to_cuda(batch)
        outputs = model(**batch)
        loss = outputs[0]
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()
        print(f"step {step} loss {loss.item():.6f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-t", "--task", default="mrpc")
    parser.add_argument(
        "-p",
        "--plugin",
        type=str,
        default="torch_ddp",
        choices=["torch_ddp", "torch_ddp_fp16", "gemini", "low_level_zero"],
    )
    parser.add_argument("--target_f1", type=float, default=None)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--num_samples", type=int, default=3668)
    args = parser.parse_args()

    shardwise.launch_from_torch(seed=42)
    coordinator = DistCoordinator()
    lr = LEARNING_RATE * coordinator.world_size

    booster_kwargs = {}
    if args.plugin == "torch_ddp_fp16":
        booster_kwargs["mixed_precision"] = "fp16"
    if args.plugin.startswith("torch_ddp"):
        plugin = TorchDDPPlugin()
    elif args.plugin == "gemini":
        plugin = GeminiPlugin(placement_policy="static", strict_ddp_mode=True, initial_scale=2**5)
    elif args.plugin == "low_level_zero":
        plugin = LowLevelZeroPlugin(initial_scale=2**5)

    booster = Booster(plugin=plugin, **booster_kwargs)

    train_dataloader = plugin.prepare_dataloader(
        synthetic_pairs(args.num_samples, seed=0),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
    )
    test_dataloader = plugin.prepare_dataloader(
        synthetic_pairs(args.num_samples // 2, seed=1), batch_size=args.batch_size
    )

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=SEQ, num_labels=2,
    )  # fmt: skip
    model = BertForSequenceClassification(config)

    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [
                p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)
            ],
            "weight_decay": WEIGHT_DECAY,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = HybridAdam(optimizer_grouped_parameters, lr=lr, eps=1e-8)

    total_steps = len(train_dataloader) * NUM_EPOCHS
    num_warmup_steps = int(WARMUP_FRACTION * total_steps)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=num_warmup_steps, num_training_steps=total_steps
    )

    model, optimizer, _, _, lr_scheduler = booster.boost(
        model, optimizer, lr_scheduler=lr_scheduler
    )

    for epoch in range(NUM_EPOCHS):
        train_epoch(epoch, model, optimizer, lr_scheduler, train_dataloader, booster)

    results = evaluate(model, test_dataloader, coordinator)
    if coordinator.is_master():
        print(results)
        if args.target_f1 is not None and "f1" in results:
            assert results["f1"] >= args.target_f1, (
                f"f1 score {results['f1']} is lower than target {args.target_f1}"
            )


if __name__ == "__main__":
    main()
