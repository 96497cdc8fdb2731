"""The callback's options and TrainingArguments, resolved once into one engine configuration.

Every setting that conflicts between the two, or that the engine cannot honour under the
Trainer, is collected and reported in a single ValueError, so a user fixes a script in one go:
the callback's own checks of TrainingArguments, and the refusal the engine's configuration
raises as it is built (its parts validate themselves; nothing here repeats them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise import Chunking, Communication, EngineConfig, MixedPrecision, Placement, Topology
from shardwise.amp import LossScaleConfig
from shardwise.engine.refine import Parts, framework_config
from shardwise.gemini import DevicePlacement, placement_policy

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class CallbackOptions:
    """What the user gave `ShardwiseCallback`; "auto" means "as TrainingArguments say"."""

    engine_config: EngineConfig | None = None
    zero_stage: int = 3
    placement_policy: str = "auto"
    chunk_size: int | None = None
    precision: str = "auto"
    device_budget_bytes: int | None = None
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    shard_size: int | None = None
    secondary_shard_size: int | None = None
    # The wire formats, checked when the callback is built (`communication_settings`).
    communication: Communication = field(default_factory=Communication)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSettings:
    """The resolved configuration: the engine's, and what the callback does around it."""

    zero_stage: int
    device: torch.device
    precision: str
    config: EngineConfig
    max_grad_norm: float

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self.config.precision


def _precision_of(args: Any) -> str:
    if getattr(args, "fp16", False):
        return "fp16"
    if getattr(args, "bf16", False):
        return "bf16"
    return "fp32"


def _parts(options: CallbackOptions) -> Parts:
    """The callback's options as the engine's settings (see [Note: engine_config and the
    arguments that refine it] in shardwise/engine/refine.py)."""
    stage, name = options.zero_stage, options.placement_policy
    # "auto" places stage 3's chunks; stages 1-2 keep the optimizer side on the device.
    policy = placement_policy(name) if stage == 3 or name != "auto" else DevicePlacement()
    return {
        "stage": stage,
        # Stages 1-2: elements per gradient bucket; stage 3: per chunk (None searches one).
        "chunking": Chunking(size_numel=options.chunk_size),
        "placement": Placement(policy=policy, device_budget_bytes=options.device_budget_bytes),
        "topology": Topology(
            shard_size=options.shard_size, secondary_shard_size=options.secondary_shard_size
        ),
        "communication": options.communication,
    }


def _engine_config(options: CallbackOptions, precision: str, device: torch.device) -> EngineConfig:
    setting = (
        f"ShardwiseCallback(precision={options.precision!r})"
        if options.precision != "auto"
        else f"TrainingArguments ({precision})"
    )
    return framework_config(
        options.engine_config,
        device=device,
        dtype=_DTYPES[precision],
        asked=_parts(options),
        defaults=_parts(CallbackOptions()),
        caller="ShardwiseCallback",
        precision_setting=setting,
    )


def _argument_conflicts(args: Any, trainer: Any) -> list[str]:
    """TrainingArguments (and Trainer set-ups) the sharded engine cannot honour."""
    found = []
    if getattr(args, "deepspeed", None):
        found.append("deepspeed is set: DeepSpeed and shardwise both shard the model; drop one")
    if getattr(args, "fsdp", None):
        found.append(f"fsdp={args.fsdp!r}: FSDP and shardwise both shard the model; drop one")
    if getattr(args, "auto_find_batch_size", False):
        found.append("auto_find_batch_size=True rebuilds the model wrapper; set it False")
    for name in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, name, False):
            found.append(
                f"{name}=True casts the model's parameters, which are views of the engine's "
                f"chunks; set it False (evaluation computes in the engine's precision)"
            )
    if getattr(args, "restore_callback_states_from_checkpoint", False):
        found.append(
            "restore_callback_states_from_checkpoint=True would replace the ShardwiseCallback "
            "that owns the engine; set it False (the engine state is restored anyway)"
        )
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    trainer_ranks = getattr(args, "world_size", ranks)
    if ranks > 1 and trainer_ranks != ranks:
        mode = getattr(args, "parallel_mode", None)
        found.append(
            f"the Trainer does not run distributed (TrainingArguments world_size="
            f"{trainer_ranks}, parallel_mode={getattr(mode, 'value', mode)!r}) although the "
            f"process group has {ranks} ranks: every rank would train on the whole dataset and "
            f"the gradients of {ranks} copies of each batch would be averaged. On a CPU host "
            f"pass use_cpu=True (--use_cpu); elsewhere give each rank its own device "
            f"(torchrun --nproc-per-node=<devices>)"
        )
    if getattr(args, "n_gpu", 1) > 1:
        found.append(
            f"n_gpu={args.n_gpu} (one process driving several GPUs): launch one process per "
            f"device with torchrun"
        )
    if trainer is not None and getattr(trainer, "model_init", None) is not None:
        found.append("model_init is set: pass the model itself to Trainer(model=...)")
    return found


def resolve(options: CallbackOptions, args: Any, trainer: Any = None) -> EngineSettings:
    """Fill the "auto" options from `args` (a TrainingArguments) and check both together.

    Raises one ValueError listing every conflict found, each with its fix."""
    problems: list[str] = []
    if options.zero_stage == 0 or (
        options.engine_config is not None and options.engine_config.stage == 0
    ):
        problems.append(
            "zero_stage 0 keeps no optimizer side for the Trainer's optimizer to step; use "
            "1, 2 or 3"
        )
    if options.precision not in PRECISIONS:
        problems.append(f"precision must be one of {PRECISIONS}, got {options.precision!r}")
    args_precision = _precision_of(args)
    precision = options.precision if options.precision != "auto" else args_precision
    if (
        options.precision in _DTYPES
        and args_precision != "fp32"
        and options.precision != args_precision
    ):
        problems.append(
            f"precision={options.precision!r} but TrainingArguments ask for {args_precision} "
            f"({args_precision}=True): make them agree or leave precision='auto'"
        )
    problems.extend(_argument_conflicts(args, trainer))
    device = torch.device(args.device)
    config = None
    if precision in _DTYPES:
        try:
            config = _engine_config(options, precision, device)
        except (TypeError, ValueError) as refused:
            problems.append(str(refused))  # the engine's own refusal, listed with the rest
    if problems or config is None:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise ValueError(
            f"ShardwiseCallback cannot train with these settings ({len(problems)} problem"
            f"{'s' if len(problems) > 1 else ''}):\n{listed}"
        )
    return EngineSettings(
        zero_stage=config.stage,
        device=device,
        precision=precision,
        config=config,
        max_grad_norm=float(args.max_grad_norm or 0.0),
    )
