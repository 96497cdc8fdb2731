"""The seed API's string-keyed options, parsed into the one `EngineConfig`, once.

[Note: one configuration]
Every front door (`zero_model_wrapper`'s `gemini_config`, `zero_optim_wrapper`'s arguments and
`optim_config`, `GeminiDDP`'s managers, `ShardedModelV2`, `ColoDDP` (stage 0), the Lightning
strategies, the Trainer callback) translates its arguments into an `EngineConfig`
(engine/config.py), whose parts validate themselves when built; the model and optimizer are
built from that config alone, through engine/wrap.py (`model_parts`, `wrap_model`,
`wrap_optimizer`; ColoDDP, not a `ZeroModel`, takes only its chunk manager from
engine/build.py). A value is checked in one place: its config part. This module holds the
translations of the dictionaries, the only place their keys are known; the engine below never
imports this package (tests/unit/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.engine.communication import communication_settings
from shardwise.engine.config import (
    DEFAULT_REDUCE_BUCKET_NUMEL,
    Chunking,
    EngineConfig,
    MixedPrecision,
    Overlap,
    Placement,
    Reduction,
    Topology,
)
from shardwise.engine.devices import compute_device, pins_host_copies
from shardwise.gemini import DevicePlacement, placement_policy, replicated

GEMINI_CONFIG_KEYS = (
    "device",
    "placement_policy",
    "pin_memory",
    "host_buffer_pool",
    "force_outputs_fp32",
    "strict_ddp_mode",
    "chunk_size_numel",
    "hidden_dim",
    "mixed_precision",
    "process_group",
    "prefetch",
    "device_budget_bytes",
    "shard_param_frac",
    "offload_optim_frac",
    "offload_param_frac",
    "chunk_search_range",
    "chunk_search_n_grids",
    "min_chunk_size",
    "gpu_margin_mem_ratio",
    "activation_memory_bytes",
    "gradient_reduction",
    "reduce_scatter_bucket_bytes",
    "param_init_fn",
    "gather_units",
    "shard_size",
    "secondary_shard_size",
    "nvme_offload_fraction",
    "nvme_offload_dir",
    "host_budget_bytes",
    "gather_format",
    "reduce_format",
    "quant_block_numel",
    "fp8_communication",
)
# What stages 1 and 2 take from `gemini_config`; their bucket size is `optim_config`'s.
LOW_LEVEL_KEYS = (
    "device",
    "placement_policy",
    "pin_memory",
    "host_buffer_pool",
    "mixed_precision",
    "process_group",
    "force_outputs_fp32",
    "gradient_reduction",
    "param_init_fn",
    "shard_size",
    "nvme_offload_fraction",
    "nvme_offload_dir",
    "host_budget_bytes",
    "gather_format",
    "reduce_format",
    "quant_block_numel",
    "fp8_communication",
)
OPTIM_CONFIG_KEYS = (
    "reduce_bucket_size",
    "overlap_communication",
    "overlap_param_gather",
    "cpu_offload",
)


def engine_config(stage: int, gemini_config: Mapping[str, Any] | None) -> EngineConfig:
    """`zero_model_wrapper`'s arguments as the engine configuration.

    Stage 3 takes every key of `GEMINI_CONFIG_KEYS` (see `GeminiDDP`); stages 1 and 2 those of
    `LOW_LEVEL_KEYS`, their bucket size and overlap coming from `zero_optim_wrapper`
    (`with_optim_config`)."""
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise TypeError(f"zero_stage must be an int (1, 2 or 3), got {stage!r}")
    if stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {stage}")
    options = dict(gemini_config or {})
    known = GEMINI_CONFIG_KEYS if stage == 3 else LOW_LEVEL_KEYS
    unknown = sorted(set(options) - set(known))
    if unknown and stage == 3:
        raise ValueError(f"gemini_config keys {unknown} are unknown; known keys: {list(known)}")
    if unknown:
        raise ValueError(
            f"gemini_config keys {unknown} have no meaning at stage {stage}; "
            f"stages 1 and 2 take {list(known)}"
        )
    for name in ("pin_memory", "force_outputs_fp32", "strict_ddp_mode", "prefetch"):
        if not isinstance(options.get(name, name == "prefetch"), bool):
            raise TypeError(f"{name} must be a bool, got {options[name]!r}")
    device = compute_device(options.get("device"))
    return EngineConfig(
        stage=stage,
        device=device,
        precision=_precision(options.get("mixed_precision", MixedPrecision())),
        chunking=_chunking(options) if stage == 3 else Chunking(),
        placement=_placement(options, device),
        reduction=Reduction(
            method=options.get("gradient_reduction", "auto"),
            bucket_bytes=options.get("reduce_scatter_bucket_bytes", 0),
        ),
        overlap=Overlap(prefetch=options.get("prefetch", True)),
        topology=Topology(
            process_group=options.get("process_group"),
            shard_size=options.get("shard_size"),
            secondary_shard_size=options.get("secondary_shard_size"),
        ),
        # Wire formats (see [Note: wire formats] in chunk/wire/formats.py); fp8_communication
        # is GeminiDDP's keyword, which ColossalAI's gemini_config passes on.
        communication=communication_settings(
            gather_format=options.get("gather_format", "dtype"),
            reduce_format=options.get("reduce_format", "dtype"),
            quant_block_numel=options.get("quant_block_numel", DEFAULT_QUANT_BLOCK_NUMEL),
            fp8_communication=options.get("fp8_communication", False),
        ),
        gather_units=_gather_units(options.get("gather_units", ())),
        force_outputs_fp32=options.get("force_outputs_fp32", False),
        param_init_fn=options.get("param_init_fn"),
    )


def with_optim_config(config: EngineConfig, optim_config: Mapping[str, Any] | None) -> EngineConfig:
    """`config` with `zero_optim_wrapper`'s `optim_config`: stages 1-2 take their bucket size
    (`reduce_bucket_size`, elements) and overlap settings there; stage 3 none of them."""
    options = dict(optim_config or {})
    unknown = sorted(set(options) - set(OPTIM_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"optim_config keys {unknown} are unknown; known keys: {list(OPTIM_CONFIG_KEYS)}"
        )
    if config.stage == 3:
        if options:
            raise ValueError(
                f"optim_config {sorted(options)} applies to stages 1 and 2; at stage 3 the "
                f"chunk size (gemini_config['chunk_size_numel']) sets the reduction granularity"
            )
        return config
    bucket = options.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET_NUMEL)
    placement = config.placement
    if "cpu_offload" in options:
        placement = _offloaded(config.placement, options["cpu_offload"])
    # Overlapping was faster in every interleaved stage-2 measurement here, and costs only the
    # buckets in flight; see `Overlap` for the defaults.
    overlap = Overlap(
        communication=options.get("overlap_communication", True),
        param_gather=options.get("overlap_param_gather"),
        prefetch=config.overlap.prefetch,
    )
    return replace_parts(
        config, chunking=Chunking(size_numel=bucket), overlap=overlap, placement=placement
    )


def _offloaded(placement: Placement, cpu_offload: object) -> Placement:
    """`optim_config["cpu_offload"]`: the optimizer side in host memory (placement "cpu"),
    or on the device; refused where `gemini_config["placement_policy"]` said otherwise."""
    if not isinstance(cpu_offload, bool):
        raise TypeError(f"optim_config['cpu_offload'] must be a bool, got {cpu_offload!r}")
    wanted = "cpu" if cpu_offload else "cuda"
    if placement.policy != DevicePlacement() and placement.policy.name != wanted:
        raise ValueError(
            f"optim_config['cpu_offload']={cpu_offload} contradicts "
            f"gemini_config['placement_policy']={placement.policy.name!r}; set one of them"
        )
    return replace(placement, policy=placement_policy(wanted))


def replace_parts(config: EngineConfig, **parts: Any) -> EngineConfig:
    """`config` with some parts replaced (validated again as a whole)."""
    return replace(config, **parts)


def _precision(value: object) -> MixedPrecision:
    if isinstance(value, torch.dtype):
        return MixedPrecision(param_dtype=value)
    if not isinstance(value, MixedPrecision):
        raise TypeError(f"mixed_precision must be a MixedPrecision or torch.dtype, got {value!r}")
    return value


def _chunking(options: Mapping[str, Any]) -> Chunking:
    defaults = Chunking()
    return Chunking(
        size_numel=options.get("chunk_size_numel"),
        search_range_bytes=options.get("chunk_search_range", defaults.search_range_bytes),
        search_n_grids=options.get("chunk_search_n_grids", defaults.search_n_grids),
        min_chunk_bytes=options.get("min_chunk_size", defaults.min_chunk_bytes),
        hidden_dim=options.get("hidden_dim"),
    )


def _placement(options: Mapping[str, Any], device: torch.device) -> Placement:
    policy = placement_policy(
        options.get("placement_policy", "cuda"),
        shard_param_frac=options.get("shard_param_frac", 1.0),
        offload_optim_frac=options.get("offload_optim_frac", 0.0),
        offload_param_frac=options.get("offload_param_frac", 0.0),
        gpu_margin_mem_ratio=options.get("gpu_margin_mem_ratio"),
        activation_memory_bytes=options.get("activation_memory_bytes"),
    )
    if options.get("strict_ddp_mode", False):
        policy = replicated(policy)  # parameters replicated on every rank, as ColossalAI's
    return Placement(
        policy=policy,
        device_budget_bytes=options.get("device_budget_bytes"),
        # Not given: the engine's rule (pinned where host copies feed a CUDA device, from the
        # engine's pool: see [Note: pinned buffers, pooled] in memory/pinned.py).
        pin_memory=options.get("pin_memory", pins_host_copies(device)),
        host_buffer_pool=options.get("host_buffer_pool", False),
        # The disk tier (see [Note: the disk tier] in memory/disk_pool.py).
        disk_fraction=options.get("nvme_offload_fraction", 0.0),
        disk_dir=options.get("nvme_offload_dir"),
        host_budget_bytes=options.get("host_budget_bytes"),
    )


def _gather_units(value: object) -> tuple[Any, ...]:
    if isinstance(value, (str, type)) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"gather_units must be a list of module classes or qualified module names, "
            f"got {value!r}"
        )
    return tuple(value)
