"""Runs under `torchrun --nproc-per-node=2`: plain Trainer runs against the same runs with
ShardwiseCallback, a save, a resume and a conflicting set-up; writes what it saw as JSON.

    torchrun --standalone --nproc-per-node=2 tests/hf/trainer_run.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

from shardwise_hf import ShardwiseCallback

VOCAB, SEQ, SAMPLES = 96, 16, 16
PROBE = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB  # (B, T) input for the logits checks


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=SEQ,
            )
        )
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in tokens]


def arguments(out: Path, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": 6,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-2,
        "warmup_steps": 1,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def history(trainer: Trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "loss" in entry]


def probe_logits(callback: ShardwiseCallback) -> torch.Tensor:
    assert callback.model is not None
    callback.model.eval()
    with torch.no_grad():
        return callback.model(input_ids=PROBE).logits.float()


def run_kind(kind: str, out: Path, stage: int, chunk: int | None) -> dict[str, Any]:
    rank = dist.get_rank()
    seen: dict[str, Any] = {}
    data = dataset()

    plain = Trainer(model=build(kind), args=arguments(out / "plain"), train_dataset=data)
    plain.train()
    seen["plain_loss"] = history(plain, "loss")
    seen["plain_grad_norm"] = history(plain, "grad_norm")

    model = build(kind)
    seen["numel"] = sum(p.numel() for p in model.parameters())
    callback = ShardwiseCallback(zero_stage=stage, chunk_size=chunk)
    sharded = Trainer(
        model=model,
        args=arguments(out / "sharded", save_strategy="steps", save_steps=3),
        train_dataset=data,
        callbacks=[callback],
    )
    sharded.train()
    seen["loss"] = history(sharded, "loss")
    seen["grad_norm"] = history(sharded, "grad_norm")
    seen["loss_scale"] = history(sharded, "loss_scale")
    seen["model_state_bytes_logged"] = history(sharded, "model_state_bytes")
    assert callback.model is not None and callback.optimizer is not None
    report = callback.model.memory_report()
    mine = {**report, "optimizer": callback.optimizer.state_bytes()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    seen["bytes_per_rank"] = every
    sharded.save_model(str(out / "final"))
    if rank == 0:
        # The same whole weights through save_pretrained with a small shard size: an index.
        sharded.model.save_pretrained(str(out / "final_split"), max_shard_size="20KB")
    logits = probe_logits(callback)
    if rank == 0:
        torch.save(logits, out / "logits.pt")

    again = ShardwiseCallback(zero_stage=stage, chunk_size=chunk)
    resumed = Trainer(
        model=build(kind),
        args=arguments(out / "sharded", save_strategy="steps", save_steps=3),
        train_dataset=data,
        callbacks=[again],
    )
    resumed.train(resume_from_checkpoint=str(out / "sharded" / "checkpoint-3"))
    seen["resumed_loss"] = history(resumed, "loss")
    seen["resumed_logits_equal"] = bool(torch.equal(probe_logits(again), logits))
    seen["resumed_logits_max_diff"] = float((probe_logits(again) - logits).abs().max())
    dist.barrier()
    return seen


def conflicts(out: Path) -> str:
    try:
        Trainer(
            model=build("llama"),
            args=arguments(
                out / "conflict",
                bf16=True,
                auto_find_batch_size=True,
                restore_callback_states_from_checkpoint=True,
            ),
            train_dataset=dataset(),
            callbacks=[ShardwiseCallback(chunk_size=0, precision="fp16")],
        )
    except ValueError as error:
        return str(error)
    return ""


def fp16_runs(out: Path) -> dict[str, Any]:
    """fp16 storage and loss scaling asked of the callback (a CPU Trainer refuses fp16=True):
    one run whose scale starts far too high, so every step overflows and is skipped, and one
    with the default scale."""
    seen: dict[str, Any] = {}
    for name, scale in (
        ("overflowing", {"initial_scale": 2**40, "max_scale": 2**48}),
        ("default", {}),
    ):
        callback = ShardwiseCallback(precision="fp16", hysteresis=1, **scale)
        trainer = Trainer(
            model=build("llama"),
            args=arguments(out / f"fp16_{name}"),
            train_dataset=dataset(),
            callbacks=[callback],
        )
        trainer.train()
        assert callback.optimizer is not None
        seen[name] = {
            "loss": history(trainer, "loss"),
            "loss_scale": history(trainer, "loss_scale"),
            "learning_rate": history(trainer, "learning_rate"),
            "overflows": callback.optimizer.grad_scaler.num_overflows,
        }
    return seen


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    results = {
        "llama": run_kind("llama", out / "llama", stage=3, chunk=4096),
        "gpt2": run_kind("gpt2", out / "gpt2", stage=3, chunk=None),
        "fp16": fp16_runs(out),
        "conflict_error": conflicts(out),
    }
    if dist.get_rank() == 0:
        (out / "seen.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
