"""Fine-tune a small causal language model with transformers.Trainer, sharded by shardwise.

    torchrun --standalone --nproc-per-node=2 examples/hf_trainer.py [--steps 20] [--out hf_out]

A normal Trainer script: the one shardwise line is `callbacks=[ShardwiseCallback(...)]`.
The model is built from a config (no download), trains on random tokens and is evaluated on
held-out ones during and after training; the trained model is saved as an ordinary Hugging Face
checkpoint that `from_pretrained` loads.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from shardwise_hf import ShardwiseCallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="hf_out")
    options = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, config.vocab_size, (80, 32))
    data = [{"input_ids": row, "labels": row} for row in tokens[:64]]
    held_out = [{"input_ids": row, "labels": row} for row in tokens[64:]]

    args = TrainingArguments(
        output_dir=options.out,
        max_steps=options.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=5,
        per_device_eval_batch_size=4,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=held_out,
        callbacks=[ShardwiseCallback(zero_stage=3)],  # the one added line
    )
    trainer.train()
    trainer.evaluate()
    trainer.save_model(f"{options.out}/final")
    trainer.end()  # destroys the process group: a process exiting with it alive may abort


if __name__ == "__main__":
    main()
