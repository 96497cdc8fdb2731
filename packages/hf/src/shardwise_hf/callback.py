"""ShardwiseCallback: add it to a transformers.Trainer and the model trains sharded."""

from __future__ import annotations

import math
import os
import secrets
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from shardwise import EngineConfig, ZeroModel, ZeroOptimizer, telemetry
from shardwise.amp import LossScaleConfig, loss_scale_from
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.engine.communication import communication_settings
from shardwise.engine.refine import checked_engine_config
from shardwise.engine.wrap import wrap_model, wrap_optimizer
from shardwise.telemetry import TelemetryRecorder
from shardwise_hf import engine_state
from shardwise_hf.compat import check_transformers_version, find_trainer
from shardwise_hf.model_hooks import ModelHooks
from shardwise_hf.settings import CallbackOptions, EngineSettings, resolve
from shardwise_hf.trainer_objects import (
    EngineLossScaler,
    TrainerModel,
    TrainerOptimizer,
    mark_prepared,
)


class ShardwiseCallback(TrainerCallback, ExportableState):
    """Train a `transformers.Trainer`'s model with the shardwise ZeRO engine.

    Add it to an existing script launched with torchrun:
    `Trainer(..., callbacks=[ShardwiseCallback()])`. When the Trainer is built, the callback
    wraps its model (parameters, gradients and optimizer state sharded over the ranks), wraps
    the optimizer the Trainer would build (`optim`, `learning_rate`, weight decay groups, or the
    one passed in `optimizers=`), and puts both where the Trainer's loop calls them (see
    [Note: how the Trainer's loop reaches the engine]). Precision follows `fp16` / `bf16`,
    clipping follows `max_grad_norm`, accumulation `gradient_accumulation_steps`; the LR
    scheduler keeps stepping the inner optimizer's param groups. `trainer.save_model()` writes
    an ordinary Hugging Face checkpoint; Trainer checkpoints also hold the sharded engine state,
    so `train(resume_from_checkpoint=...)` continues exactly. Evaluation (`eval_strategy`,
    `evaluate()`, `predict()`, `load_best_model_at_end`) works as without it. Loss scale and
    model-state bytes are added to the Trainer's logs; telemetry streams when configured
    (`SHARDWISE_DASHBOARD_URL` or `SHARDWISE_TELEMETRY_FILE`). `torch_compile=True` compiles
    the sharded model as a whole (with `torch_compile_backend` and `torch_compile_mode`).

    Args:
        zero_stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
        placement_policy: where stage-3 chunks live ("cuda"/"device", "cpu", "static",
            "auto"); "auto" keeps them on the compute device on a CPU host without
            `device_budget_bytes`, and lets Gemini place them against the budget otherwise.
        chunk_size: elements per chunk (stage 3) or gradient bucket (stages 1-2); None searches
            a chunk size at stage 3.
        precision: "auto" (from TrainingArguments' fp16/bf16), "fp32", "bf16" or "fp16".
            16-bit parameters are stored and communicated in 16 bits with fp32 master weights;
            on a CPU the compute runs in fp32.
        device_budget_bytes: the device memory the "auto" placement may fill with model state.
        shard_size: hybrid sharding: shard over groups of this many consecutive ranks (e.g.
            the devices of one node) and replicate across the groups; None shards over all.
        secondary_shard_size: ZeRO++ hpZ: keep a secondary copy of each chunk sharded over
            groups of this many consecutive ranks from forward to backward, whose gathers then
            stay inside a group; 1 keeps each rank's whole copy (no gather in backward); None:
            backward gathers over every rank.
        gather_format: parameter all-gathers (stage 3 before each module, stages 1-2 after
            the step): "dtype" (the precision's, default), "int8" or "fp8" (ZeRO++'s qwZ: one
            byte per value with an fp32 scale per block; each rank keeps its own slice and its
            fp32 masters exact).
        reduce_format: gradient reductions: "dtype" (default), "int8" or "fp8" (ZeRO++'s qgZ:
            an all-to-all of quantized slices, summed in fp32 by their owner).
        quant_block_numel: values per quantization block, each with one fp32 scale.
        initial_scale, growth_interval, hysteresis, min_scale, max_scale: the dynamic loss
            scale used with fp16.
        engine_config: the engine's whole configuration (`shardwise.EngineConfig`), every
            setting of the engine among it: the disk tier, `host_buffer_pool`,
            `gather_units`, the prefetch settings, ... The other arguments refine it: one left
            at its default keeps engine_config's value, one given another value replaces the
            settings it stands for (see [Note: engine_config and the arguments that refine
            it] in shardwise/engine/refine.py). Its device must be of the type
            TrainingArguments' device is (each rank computes on its own); its precision,
            unless left at its default, must store in the precision the callback resolves.
            Checked when the callback is attached, with every other conflict.
        loss_scale: the loss scale's seven settings as one `shardwise.amp.LossScaleConfig`
            (growth_factor and backoff_factor among them), which the separate ones refine
            (one left at its default keeps loss_scale's value).
    """

    def __init__(
        self,
        zero_stage: int = 3,
        placement_policy: str = "auto",
        chunk_size: int | None = None,
        *,
        precision: str = "auto",
        device_budget_bytes: int | None = None,
        shard_size: int | None = None,
        secondary_shard_size: int | None = None,
        gather_format: str = "dtype",
        reduce_format: str = "dtype",
        quant_block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL,
        initial_scale: float = 2**16,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1,
        max_scale: float = 2**32,
        engine_config: EngineConfig | None = None,
        loss_scale: LossScaleConfig | None = None,
    ) -> None:
        self.options = CallbackOptions(
            engine_config=checked_engine_config(engine_config, type(self).__name__),
            zero_stage=zero_stage,
            placement_policy=placement_policy,
            chunk_size=chunk_size,
            precision=precision,
            device_budget_bytes=device_budget_bytes,
            shard_size=shard_size,
            secondary_shard_size=secondary_shard_size,
            # Checked now, each bad value with its setting named (a TypeError or ValueError).
            communication=communication_settings(
                gather_format=gather_format,
                reduce_format=reduce_format,
                quant_block_numel=quant_block_numel,
                caller=type(self).__name__,
            ),
            loss_scale=loss_scale_from(ShardwiseCallback.__init__, locals(), loss_scale),
        )
        self.settings: EngineSettings | None = None
        self.model: ZeroModel | None = None
        self.optimizer: ZeroOptimizer | None = None
        self.checkpoint_token = secrets.token_hex(8)
        self._hooks: ModelHooks | None = None
        self._recorder: TelemetryRecorder | None = None
        self._resumed_at: int | None = None
        self._saving_to: str | None = None
        self._training = False

    # ---- set-up ------------------------------------------------------------------------------

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.model is None:
            self.attach(find_trainer(self))

    def attach(self, trainer: Trainer) -> None:
        """Shard `trainer`'s model and optimizer and hand the Trainer the objects its loop
        calls. Runs by itself when the Trainer is built with this callback."""
        check_transformers_version()
        if self.model is not None:
            raise ValueError("this ShardwiseCallback already drives a Trainer; make a new one")
        if trainer.model is None:
            raise ValueError("the Trainer has no model: pass Trainer(model=...)")
        settings = resolve(self.options, trainer.args, trainer)
        # In order: the engine takes over the module's parameters (same Parameter objects, now
        # views of chunks), so the optimizer the Trainer builds over them can be wrapped next.
        model = wrap_model(trainer.model, settings.config)
        inner = trainer.optimizer if trainer.optimizer is not None else trainer.create_optimizer()
        optimizer = wrap_optimizer(
            model, inner, loss_scale=self.options.loss_scale, max_norm=settings.max_grad_norm
        )
        facing = TrainerOptimizer(optimizer)
        trainer.model_wrapped = TrainerModel(model, _compile_options(trainer.args))
        # Evaluation runs trainer.model itself; accelerate must not move, cast or autocast it
        # (see [Note: evaluation runs the user's model]).
        mark_prepared(trainer.model)
        trainer.optimizer = facing
        trainer.accelerator.scaler = EngineLossScaler(facing)
        # The engine clips over every rank's shards (max_grad_norm was handed to it above). The
        # Trainer's own clip_grad_norm_ over model.parameters() would scale stage 1's averaged
        # `.grad` in place, under the engine's own clipping of it: it clips nothing here, and
        # on_log reports the engine's norm.
        trainer.accelerator.clip_grad_norm_ = _engine_clips
        self.settings, self.model, self.optimizer = settings, model, optimizer
        if dist.is_initialized():
            # Every rank stamps the engine state alike (rank 0's token).
            chosen = [self.checkpoint_token]
            dist.broadcast_object_list(chosen, src=0)
            self.checkpoint_token = str(chosen[0])
        self._hooks = ModelHooks(model)

    def _engine(self) -> tuple[ZeroModel, ZeroOptimizer, ModelHooks]:
        if self.model is None or self.optimizer is None or self._hooks is None:
            raise RuntimeError("ShardwiseCallback is not attached to a Trainer")
        return self.model, self.optimizer, self._hooks

    # ---- training ----------------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model, optimizer, hooks = self._engine()
        hooks.drop()
        self._training = True
        if state.global_step > 0 and self._resumed_at != state.global_step:
            recorded = _recorded_state(state, type(self).__name__)
            token = recorded.get("checkpoint_token")
            if not token:
                raise ValueError(
                    f"resuming at step {state.global_step} from a checkpoint without shardwise "
                    f"engine state: it was written by a run without ShardwiseCallback"
                )
            places = engine_state.candidates(args.output_dir or ".", state.global_step, recorded)
            engine_state.load_matching(places, token, model, optimizer)
            self._resumed_at = state.global_step
        if self._recorder is None:
            self._recorder = telemetry.enable(
                model, optimizer, run_name=args.run_name, entry_point="HF Trainer"
            )

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._engine()[2].drop()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._before_save(args, state, control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._before_save(args, state, control)

    def _before_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl
    ) -> None:
        """A checkpoint follows: gather the whole model for rank 0's save_pretrained (see
        [Note: whole weights for save_pretrained]) and note where the engine state will go."""
        if control.should_save:
            self._engine()[2].gather()
            self._saving_to = os.path.abspath(_checkpoint_dir(args, state))

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # With save_strategy="best" the Trainer decides to save only after this evaluation,
        # when no callback runs before rank 0's save_pretrained: gather now, on every rank, in
        # case this evaluation is the new best (the next step's start drops it otherwise).
        if self._training and args.save_strategy == "best":
            self._engine()[2].gather()
            self._saving_to = os.path.abspath(_checkpoint_dir(args, state))
        loss = _eval_loss(kwargs.get("metrics") or {})
        if self._recorder is not None and loss is not None and state.global_step > 0:
            # The dashboard's evaluation loss, after the step it followed (0-based there).
            self._recorder.evaluated(state.global_step - 1, loss)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model, optimizer, hooks = self._engine()
        hooks.drop()
        engine_state.save(_checkpoint_dir(args, state), model, optimizer, self.checkpoint_token)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is None or "loss" not in logs:
            return
        model, optimizer, _ = self._engine()
        added: dict[str, Any] = {
            "loss_scale": optimizer.loss_scale,
            "model_state_bytes": sum(model.memory_report().values()),
            "optimizer_state_bytes": optimizer.state_bytes(),
        }
        if "grad_norm" in logs:
            # The Trainer's own norm saw no .grad; the engine's is over every rank's shards.
            norm = optimizer.last_grad_norm
            added["grad_norm"] = norm if math.isfinite(norm) else float("nan")
        logs.update(added)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(added)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # trainer.save_model() usually follows, and runs on rank 0 only.
        self._training = False
        self._engine()[2].gather()
        if self._recorder is not None:
            self._recorder.finish()
            self._recorder = None

    # ---- ExportableState: the stamp of the engine state, kept in trainer_state.json ------------

    def state(self) -> dict[str, Any]:
        return {
            "args": {},
            "attributes": {
                "checkpoint_token": self.checkpoint_token,
                "checkpoint_dir": self._saving_to,
            },
        }


def _compile_options(args: TrainingArguments) -> dict[str, Any] | None:
    """`torch.compile`'s options from `torch_compile`, `torch_compile_backend` and
    `torch_compile_mode`, as accelerate's dynamo plugin reads them; None when not compiling."""
    if not args.torch_compile:
        return None
    options: dict[str, Any] = {"backend": args.torch_compile_backend or "inductor"}
    if args.torch_compile_mode:
        options["mode"] = args.torch_compile_mode
    return options


def _eval_loss(metrics: dict[str, Any]) -> float | None:
    """The evaluation loss the Trainer logged: "eval_loss", or an evaluation set's
    "eval_<name>_loss" when it has several."""
    if "eval_loss" in metrics:
        return float(metrics["eval_loss"])
    losses = [value for key, value in metrics.items() if key.endswith("_loss")]
    return float(losses[0]) if losses else None


def _engine_clips(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    return torch.zeros(())


def _checkpoint_dir(args: TrainingArguments, state: TrainerState) -> str:
    return os.path.join(args.output_dir or ".", f"checkpoint-{state.global_step}")


def _recorded_state(state: TrainerState, name: str) -> dict[str, Any]:
    callbacks: Any = state.stateful_callbacks or {}
    stored = callbacks.get(name, {})
    if isinstance(stored, list):
        stored = stored[0] if stored else {}
    attributes = stored.get("attributes", {}) if isinstance(stored, dict) else {}
    return attributes if isinstance(attributes, dict) else {}
