"""Runs under `torchrun --nproc-per-node=2`: plain Trainer runs against the same runs with
ShardwiseCallback at stages 1, 2 and 3, evaluating during and after training, a save, a resume,
loading the best checkpoint, activation checkpointing (reentrant and not) at every stage, a
Switch Transformers mixture of experts at stage 3, hybrid sharding (shard_size=1) at stages 2
and 3, unclipped gradient accumulation over 3 micro-batches at every stage, torch_compile=True
at stages 2 and 3, a conflicting set-up and a Trainer that does not run distributed; writes
what it saw as JSON.

    torchrun --standalone --nproc-per-node=2 tests/hf/trainer_run.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tiny_switch import tiny_switch
from trainer_support import (
    EVALUATING,
    VOCAB,
    EvalProbe,
    arguments,
    build,
    dataset,
    eval_history,
    every_rank,
    held_out,
    history,
    predictions,
    probe_logits,
)
from transformers import (
    Trainer,
    TrainerCallback,
)

from shardwise import EngineConfig, Overlap
from shardwise_hf import ShardwiseCallback


def run_kind(kind: str, out: Path, stage: int, chunk: int | None) -> dict[str, Any]:
    rank = dist.get_rank()
    seen: dict[str, Any] = {}
    data = dataset()

    # A plain Trainer that evaluates before train() then trains differently under torchrun
    # (its gradients are no longer averaged over the ranks): the reference for an evaluation
    # of the untrained model is a Trainer of its own.
    untrained = Trainer(
        model=build(kind), args=arguments(out / "plain", **EVALUATING), eval_dataset=held_out()
    )
    seen["plain_eval_before"] = untrained.evaluate()["eval_loss"]
    plain_probe = EvalProbe()
    plain = Trainer(
        model=build(kind),
        args=arguments(out / "plain", **EVALUATING),
        train_dataset=data,
        eval_dataset=held_out(),
        callbacks=[plain_probe],
    )
    plain.train()
    seen["plain_loss"] = history(plain, "loss")
    seen["plain_grad_norm"] = history(plain, "grad_norm")
    seen["plain_eval_loss"] = eval_history(plain)
    seen["plain_eval_after"] = plain.evaluate()["eval_loss"]
    plain_logits, seen["plain_predict_loss"] = predictions(plain)

    model = build(kind)
    seen["numel"] = sum(p.numel() for p in model.parameters())
    callback = ShardwiseCallback(zero_stage=stage, chunk_size=chunk)
    probe = EvalProbe(callback)
    sharded = Trainer(
        model=model,
        args=arguments(out / "sharded", save_strategy="steps", save_steps=3, **EVALUATING),
        train_dataset=data,
        eval_dataset=held_out(),
        callbacks=[probe, callback],
    )
    # Before any training step: the engine's first forward is an evaluation.
    seen["eval_before"] = sharded.evaluate()["eval_loss"]
    sharded.train()
    seen["loss"] = history(sharded, "loss")
    seen["grad_norm"] = history(sharded, "grad_norm")
    seen["loss_scale"] = history(sharded, "loss_scale")
    seen["model_state_bytes_logged"] = history(sharded, "model_state_bytes")
    seen["eval_loss"] = eval_history(sharded)
    assert callback.model is not None and callback.optimizer is not None
    report = callback.model.memory_report()
    seen["bytes_per_rank"] = every_rank({**report, "optimizer": callback.optimizer.state_bytes()})
    sharded.save_model(str(out / "final"))
    if rank == 0:
        # The same whole weights through save_pretrained with a small shard size: an index.
        sharded.model.save_pretrained(str(out / "final_split"), max_shard_size="20KB")
    logits = probe_logits(callback)
    if rank == 0:
        torch.save(logits, out / "logits.pt")
    seen["eval_after"] = sharded.evaluate()["eval_loss"]
    sharded_logits, seen["predict_loss"] = predictions(sharded)
    seen["predict_shape"] = list(sharded_logits.shape)
    seen["predict_max_diff"] = float(np.abs(sharded_logits - plain_logits).max())
    seen["eval_batches"] = every_rank([probe.batches, plain_probe.batches])
    seen["after_eval"] = every_rank(probe.after)
    # Evaluation left the user's model as it was: no forward replaced by accelerate.
    seen["forward_replaced"] = "forward" in vars(sharded.model)

    again = ShardwiseCallback(zero_stage=stage, chunk_size=chunk)
    resumed = Trainer(
        model=build(kind),
        args=arguments(out / "sharded", save_strategy="steps", save_steps=3, **EVALUATING),
        train_dataset=data,
        eval_dataset=held_out(),
        callbacks=[again],
    )
    resumed.train(resume_from_checkpoint=str(out / "sharded" / "checkpoint-3"))
    seen["resumed_loss"] = history(resumed, "loss")
    seen["resumed_eval_loss"] = eval_history(resumed)
    seen["resumed_logits_equal"] = bool(torch.equal(probe_logits(again), logits))
    seen["resumed_logits_max_diff"] = float((probe_logits(again) - logits).abs().max())
    dist.barrier()
    return seen


def lower_stages(out: Path) -> dict[str, Any]:
    """The Llama run at stages 1 and 2, evaluating, keeping the best checkpoint (lowest eval
    loss) and loading it at the end. On these random tokens the held-out loss rises after step
    3, so the best checkpoint is not the last one and loading it is seen."""
    seen: dict[str, Any] = {}
    for stage, saving in (
        (1, {"save_strategy": "steps", "save_steps": 3}),
        (2, {"save_strategy": "best"}),
    ):
        callback = ShardwiseCallback(zero_stage=stage)
        probe = EvalProbe(callback)
        trainer = Trainer(
            model=build("llama"),
            args=arguments(
                out / f"stage{stage}",
                **EVALUATING,
                **saving,
                load_best_model_at_end=True,
                metric_for_best_model="eval_loss",
            ),
            train_dataset=dataset(),
            eval_dataset=held_out(),
            callbacks=[probe, callback],
        )
        trainer.train()
        assert callback.model is not None and callback.optimizer is not None
        report = callback.model.memory_report()
        seen[f"stage{stage}"] = {
            "loss": history(trainer, "loss"),
            "grad_norm": history(trainer, "grad_norm"),
            "eval_loss": eval_history(trainer),
            "best_global_step": trainer.state.best_global_step,
            "checkpoints": sorted(p.name for p in (out / f"stage{stage}").glob("checkpoint-*")),
            "eval_after_load_best": trainer.evaluate()["eval_loss"],
            "bytes_per_rank": every_rank({**report, "optimizer": callback.optimizer.state_bytes()}),
            "after_eval": every_rank(probe.after),
        }
    return seen


def bf16_runs(out: Path) -> dict[str, Any]:
    """bf16 TrainingArguments turn on accelerate's autocast: a run evaluating at step 3 must
    train on exactly as one that does not evaluate."""
    seen: dict[str, Any] = {}
    for name, evaluating in (("evaluating", EVALUATING), ("not_evaluating", {})):
        trainer = Trainer(
            model=build("llama"),
            args=arguments(out / f"bf16_{name}", bf16=True, **evaluating),
            train_dataset=dataset(),
            eval_dataset=held_out(),
            callbacks=[ShardwiseCallback()],
        )
        trainer.train()
        seen[name] = {
            "loss": history(trainer, "loss"),
            "eval_loss": eval_history(trainer),
            "forward_replaced": "forward" in vars(trainer.model),
        }
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


def checkpointing_runs(out: Path) -> dict[str, Any]:
    """Activation checkpointing (`gradient_checkpointing=True`), reentrant and not: the plain
    Trainer and the callback at stages 1, 2 and 3; each rank counts the calls of a projection
    inside the first decoder layer (it runs again in backward when checkpointed)."""
    seen: dict[str, Any] = {}
    for reentrant in (False, True):
        kind = "reentrant" if reentrant else "non_reentrant"
        for stage in (None, 1, 2, 3):
            model = build("llama")
            calls = [0, 0]  # the projection's, the whole model's (root forward passes)

            def count(module: Any, args: Any, calls: list[int] = calls) -> None:
                calls[0] += 1

            def count_root(module: Any, args: Any, calls: list[int] = calls) -> None:
                calls[1] += 1

            model.register_forward_pre_hook(count_root)

            # transformers checkpoints a layer's forward, not its __call__: the layer's own hooks
            # run once, those of the modules inside it (the engine's gathers) run again.
            model.model.layers[0].mlp.down_proj.register_forward_pre_hook(count)
            trainer = Trainer(
                model=model,
                args=arguments(
                    out / f"checkpointing_{kind}_{stage}",
                    gradient_checkpointing=True,
                    gradient_checkpointing_kwargs={"use_reentrant": reentrant},
                ),
                train_dataset=dataset(),
                callbacks=[] if stage is None else [ShardwiseCallback(zero_stage=stage)],
            )
            trainer.train()
            seen[f"{kind}_{stage or 'plain'}"] = {
                "loss": history(trainer, "loss"),
                "grad_norm": history(trainer, "grad_norm"),
                "layer_calls": calls[0],
                "root_calls": calls[1],
                "checkpointing": bool(model.is_activation_checkpointing),
            }
    return seen


def record_expert_calls(model: torch.nn.Module) -> list[list[str]]:
    """Per forward of `model`, the experts (modules named expert_<i>) this rank called."""
    calls: list[list[str]] = []
    model.register_forward_pre_hook(lambda module, args: calls.append([]))
    for module_name, module in model.named_modules():
        if module_name.rsplit(".", 1)[-1].startswith("expert_"):

            def note(module: Any, args: Any, module_name: str = module_name) -> None:
                calls[-1].append(module_name)

            module.register_forward_pre_hook(note)
    return calls


def switch_runs(out: Path) -> dict[str, Any]:
    """A Switch Transformers model (top-1 experts behind a router) under the plain Trainer and
    under ShardwiseCallback(zero_stage=3), recording which experts each rank called."""
    seen: dict[str, Any] = {}
    for name, callbacks in (("plain", []), ("stage3", [ShardwiseCallback(zero_stage=3)])):
        torch.manual_seed(0)
        model = tiny_switch(VOCAB)
        calls = record_expert_calls(model)
        rows = [{"input_ids": r["input_ids"], "labels": r["labels"][:6]} for r in dataset()]
        trainer = Trainer(
            model=model,
            args=arguments(out / f"switch_{name}", max_grad_norm=0.0),
            train_dataset=rows,
            callbacks=callbacks,
        )
        trainer.train()
        seen[name] = {"loss": history(trainer, "loss"), "calls": every_rank(calls)}
    return seen


def hybrid_runs(out: Path) -> dict[str, Any]:
    """The Llama model under the plain Trainer and under ShardwiseCallback(shard_size=1) at
    stages 2 and 3: two shard groups of one rank, each a whole replica, the gradients
    all-reduced across them as DDP does (unclipped, so bit for bit)."""
    seen: dict[str, Any] = {}
    runs: list[tuple[str, list[TrainerCallback]]] = [
        ("plain", []),
        ("stage2", [ShardwiseCallback(zero_stage=2, shard_size=1)]),
        ("stage3", [ShardwiseCallback(zero_stage=3, shard_size=1)]),
    ]
    for name, callbacks in runs:
        trainer = Trainer(
            model=build("llama"),
            args=arguments(out / f"hybrid_{name}", max_grad_norm=0.0),
            train_dataset=dataset(),
            callbacks=callbacks,
        )
        trainer.train()
        engine = callbacks[0].model if callbacks else None
        seen[name] = {
            "loss": history(trainer, "loss"),
            "replicas": engine.chunk_manager.topology.replicas if engine is not None else 1,
        }
    return seen


def wire_runs(out: Path) -> dict[str, Any]:
    """The Llama model under ShardwiseCallback with int8 gathers and reductions at stages 2 and
    3, with hybrid_runs' arguments (unclipped), whose plain run is the reference: the losses,
    the engine's wire settings and wires, and its collective counters."""
    seen: dict[str, Any] = {}
    for stage in (2, 3):
        callback = ShardwiseCallback(
            zero_stage=stage, gather_format="int8", reduce_format="int8", quant_block_numel=64
        )
        counted = _TrainingBytes(callback)
        trainer = Trainer(
            model=build("llama"),
            args=arguments(out / f"wire_stage{stage}", max_grad_norm=0.0),
            train_dataset=dataset(),
            callbacks=[callback, counted],
        )
        trainer.train()
        engine = callback.model
        assert engine is not None
        wire = engine.config.communication
        chunks = engine.chunk_manager.chunks
        seen[f"stage{stage}"] = {
            "loss": history(trainer, "loss"),
            "communication": [wire.gather, wire.reduce, wire.block_numel],
            "wires": sorted(
                {f"{type(c.wire.gather).__name__}+{type(c.wire.reduce).__name__}" for c in chunks}
            ),
            "comm": counted.snapshot,
        }
    return seen


class _TrainingBytes(TrainerCallback):
    """The engine's collective counters after each step: the last is the training's, before
    the callback gathers the whole weights at the end of training (exactly, not on the
    wire)."""

    def __init__(self, engine: ShardwiseCallback) -> None:
        self.engine = engine
        self.snapshot: dict[str, dict[str, int]] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.engine.model is not None
        self.snapshot = self.engine.model.comm_stats.snapshot()


class SteppedInBackward(TrainerCallback):
    """How many chunks stepped during backward at each optimizer step (step_in_backward)."""

    def __init__(self, engine: ShardwiseCallback) -> None:
        self.engine = engine
        self.counts: list[int] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.engine.optimizer is not None
        self.counts.append(self.engine.optimizer.last_stepped_in_backward)


def accumulation_runs(out: Path) -> dict[str, Any]:
    """The Llama model under the plain Trainer and under ShardwiseCallback at stages 1-3 with
    3 micro-batches per step (an epoch is 4 per rank: every other step ends it early, on its
    remainder), unclipped: the losses and the final weights of each; and stage 3 with its
    chunks stepping during backward (engine_config's `Overlap(step_in_backward=True)`)."""
    seen: dict[str, Any] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    early = EngineConfig(
        stage=3, device=torch.device("cpu"), overlap=Overlap(step_in_backward=True)
    )
    for stage in (None, 1, 2, 3, "3early"):
        callback = None
        probes: list[TrainerCallback] = []
        if stage == "3early":
            callback = ShardwiseCallback(zero_stage=3, engine_config=early)
            probes = [SteppedInBackward(callback)]
        elif stage is not None:
            callback = ShardwiseCallback(zero_stage=stage)
        trainer = Trainer(
            model=build("llama"),
            args=arguments(
                out / f"accumulation_{stage or 'plain'}",
                max_grad_norm=0.0,
                gradient_accumulation_steps=3,
            ),
            train_dataset=dataset(),
            callbacks=[callback, *probes] if callback is not None else [],
        )
        trainer.train()
        name = f"stage{stage}" if stage is not None else "plain"
        if probes:
            seen["stepped_in_backward"] = probes[0].counts
        if callback is not None:
            assert callback.model is not None
            state = callback.model.state_dict(only_rank_0=False)
        else:
            state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        weights[name] = state
        seen[name] = {"loss": history(trainer, "loss")}
    for name, state in weights.items():
        plain = weights["plain"]
        seen[name]["max_weight_diff"] = max(
            float((state[k].float() - plain[k].float()).abs().max()) for k in plain
        )
    return seen


class CompileProbe(TrainerCallback):
    """What dynamo compiled from the third training step on (nothing, once warmed up)."""

    def __init__(self) -> None:
        self.late = -1

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from torch._dynamo.utils import counters

        if state.global_step == 2:
            counters.clear()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from torch._dynamo.utils import counters

        self.late = counters["stats"].get("unique_graphs", 0) + sum(counters["recompiles"].values())


def compiled_runs(out: Path) -> dict[str, Any]:
    """TrainingArguments(torch_compile=True): the plain Trainer (accelerate compiles the DDP
    model it prepares) against ShardwiseCallback at stages 2 and 3 (the callback compiles the
    sharded model), aot_eager as the backend (dynamo and AOTAutograd as under inductor, eager's
    kernels: see tests/test_compile.py), unclipped, so bit for bit."""
    seen: dict[str, Any] = {}
    runs: list[tuple[str, list[TrainerCallback]]] = [
        ("plain", []),
        ("stage2", [ShardwiseCallback(zero_stage=2)]),
        ("stage3", [ShardwiseCallback(zero_stage=3, chunk_size=4096)]),
    ]
    for name, callbacks in runs:
        torch._dynamo.reset()
        probe = CompileProbe()
        trainer = Trainer(
            model=build("llama"),
            args=arguments(
                out / f"compiled_{name}",
                max_grad_norm=0.0,
                torch_compile=True,
                torch_compile_backend="aot_eager",
            ),
            train_dataset=dataset(),
            callbacks=[*callbacks, probe],
        )
        trainer.train()
        seen[name] = {"loss": history(trainer, "loss"), "compiled_late": probe.late}
    return seen


def not_distributed(out: Path) -> str:
    """Without use_cpu=True, a CPU Trainer under torchrun does not run distributed although
    the process group has 2 ranks (every rank would train on all the data)."""
    try:
        Trainer(
            model=build("llama"),
            args=arguments(out / "not_distributed", use_cpu=False),
            train_dataset=dataset(),
            callbacks=[ShardwiseCallback()],
        )
    except ValueError as error:
        return str(error)
    return ""


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    results = {
        "llama": run_kind("llama", out / "llama", stage=3, chunk=4096),
        "gpt2": run_kind("gpt2", out / "gpt2", stage=3, chunk=None),
        "lower_stages": lower_stages(out),
        "bf16": bf16_runs(out),
        "fp16": fp16_runs(out),
        "conflict_error": conflicts(out),
        "checkpointing": checkpointing_runs(out),
        "switch": switch_runs(out),
        "hybrid": hybrid_runs(out),
        "wire": wire_runs(out),
        "accumulation": accumulation_runs(out),
        "compiled": compiled_runs(out),
        # Last: TrainingArguments without use_cpu change accelerate's shared state.
        "not_distributed": not_distributed(out),
    }
    if dist.get_rank() == 0:
        (out / "seen.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
