"""What the Trainer scenarios of trainer_run.py share: the tiny models and their data, the
Trainer's arguments, an evaluation probe, and readers of what a run logged and predicted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from shardwise.chunk import ChunkState
from shardwise_hf import ShardwiseCallback

VOCAB, SEQ, SAMPLES, EVAL_SAMPLES = 96, 16, 16, 12
# Evaluation at steps 3 and 6 of 6, on a held-out set each rank sees half of (3 batches of 2).
EVALUATING: dict[str, Any] = {
    "eval_strategy": "steps",
    "eval_steps": 3,
    "per_device_eval_batch_size": 2,
}
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


def dataset(samples: int = SAMPLES, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in tokens]


def held_out() -> list[dict[str, torch.Tensor]]:
    return dataset(EVAL_SAMPLES, seed=2)


class EvalProbe(TrainerCallback):
    """Counts this rank's evaluation batches and, after each evaluation, what the engine holds:
    chunks left gathered, non-zero gradient elements in the chunks, parameters with a `.grad`."""

    def __init__(self, engine: ShardwiseCallback | None = None) -> None:
        self.engine = engine
        self.batches = 0
        self.after: list[dict[str, int]] = []

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.batches += 1

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.engine is None or self.engine.model is None:
            return
        model = self.engine.model
        chunks = model.chunk_manager.chunks
        grads = [c.grads.shard for c in chunks if not c.grads.cleared] + [
            c.grads.full for c in chunks if c.grads.full is not None
        ]
        self.after.append(
            {
                "gathered": sum(
                    c.payload.state is ChunkState.GATHERED and not c.keep_gathered for c in chunks
                ),
                "grad_elements": sum(int(g.count_nonzero()) for g in grads),
                "param_grads": sum(p.grad is not None for p in model.module.parameters()),
            }
        )


def every_rank(value: Any) -> list[Any]:
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, value)
    return found


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


def eval_history(trainer: Trainer) -> list[tuple[int, float]]:
    """(step, eval_loss) of each evaluation during train()."""
    return [
        (entry["step"], entry["eval_loss"])
        for entry in trainer.state.log_history
        if "eval_loss" in entry and entry["step"] > 0
    ]


def predictions(trainer: Trainer) -> tuple[np.ndarray, float]:
    """`trainer.predict` on the held-out set: every sample's logits (gathered from both ranks)
    and the loss."""
    output = trainer.predict(held_out())
    logits = output.predictions
    logits = logits[0] if isinstance(logits, tuple) else logits
    assert output.metrics is not None
    return np.asarray(logits), float(output.metrics["test_loss"])


def probe_logits(callback: ShardwiseCallback) -> torch.Tensor:
    assert callback.model is not None
    callback.model.eval()
    with torch.no_grad():
        return callback.model(input_ids=PROBE).logits.float()
