"""ColossalAI 0.5's Gemini arguments (`GeminiDDP`'s keywords, which `GeminiPlugin` passes on)
translated into the one `EngineConfig` (see [Note: one configuration] in zero/front_door.py).

Where ColossalAI ignores an argument at the configuration given (a placement fraction under
another policy, `warmup_non_model_data_ratio` outside "auto", `gpu_margin_mem_ratio` outside
"auto", `offload_param_frac` unless every chunk is sharded and every optimizer side offloaded),
it is accepted and a warning
names it; an argument ColossalAI would apply and the engine cannot is refused with what to use
instead.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup

from shardwise import comm
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.engine.communication import communication_settings
from shardwise.engine.config import (
    Chunking,
    EngineConfig,
    Overlap,
    Placement,
    Topology,
    storage_precision,
)
from shardwise.engine.devices import default_device
from shardwise.gemini import placement_policy, replicated
from shardwise.gemini.manager import placement_on

_log = logging.getLogger(__name__)
GEMINI_PLACEMENTS = ("static", "auto", "cuda", "cpu")
# ColossalAI's defaults of the "auto"-only settings: accepted as they are everywhere.
AUTO_DEFAULTS = {"warmup_non_model_data_ratio": 0.8, "steady_cuda_cap_ratio": 0.9}


def gemini_engine_config(
    caller: str,
    *,
    chunk_config_dict: Mapping[int, Mapping[str, Any]] | None,
    chunk_init_device: torch.device | str | None,
    placement_policy_name: str,
    max_prefetch: int,
    shard_param_frac: float,
    offload_optim_frac: float,
    offload_param_frac: float,
    warmup_non_model_data_ratio: float,
    steady_cuda_cap_ratio: float,
    search_range_m: float,
    hidden_dim: int | None,
    min_chunk_size_m: float,
    pin_memory: bool,
    force_outputs_fp32: bool,
    strict_ddp_mode: bool,
    mixed_precision: torch.dtype,
    process_group: ProcessGroup | None,
    memstats: Any,
    master_weights: bool,
    enable_async_reduce: bool,
    fp8_communication: bool,
    use_fp8: bool,
    gpu_margin_mem_ratio: float = 0.0,
    shard_size: int | None = None,
    verbose: bool = False,
    gather_format: str = "dtype",
    reduce_format: str = "dtype",
    quant_block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL,
) -> EngineConfig:
    """Stage 3's configuration from ColossalAI's Gemini arguments, in their meaning there.

    Args:
        caller: the class named in messages (`GeminiDDP`, `GeminiPlugin`).
        chunk_config_dict: `{group size: {"chunk_size": n, "keep_gathered": bool}}`, or None to
            search the size (`search_range_m`, `min_chunk_size_m`, `hidden_dim`).
        chunk_init_device: where chunks are first built; the engine computes on the
            accelerator (the CPU without one), as ColossalAI moves chunks there when used.
        placement_policy_name: "static", "auto", or the legacy "cuda" and "cpu".
        max_prefetch: 0 gathers each chunk when first used; n >= 1 prefetches the next n
            chunks of the recorded order.
        shard_param_frac, offload_optim_frac, offload_param_frac: "static" placement.
        warmup_non_model_data_ratio, steady_cuda_cap_ratio: "auto" only; the first is left at
            0.8 ("auto" measures its warm-up itself), the second sizes the CUDA budget.
        search_range_m, hidden_dim, min_chunk_size_m: the chunk-size search, in 2**20
            elements.
        pin_memory, force_outputs_fp32: as named.
        strict_ddp_mode: keep every parameter replicated (see `gemini.replicated`).
        mixed_precision: the storage dtype (fp16, bf16, or fp32 beyond ColossalAI).
        process_group: the group to shard over (ColossalAI's `zero_group`).
        memstats: refused unless None (the engine records the order in its first iteration).
        master_weights: True only (the engine always steps fp32 masters).
        enable_async_reduce: reduce gradients in the background of backward.
        fp8_communication: gather parameters and reduce gradients in fp8 (e4m3, blockwise
            scales: ZeRO++'s qwZ and qgZ with fp8 values; see [Note: quantized gathers] and
            [Note: quantized reductions] in chunk/wire/formats.py), as ColossalAI's sends
            both in fp8; the same as gather_format="fp8" and reduce_format="fp8".
        use_fp8: refused unless False (the engine computes in the compute dtype).
        gpu_margin_mem_ratio: "auto": the share of the device room left after warm-up that
            optimizer state may use; ignored with a warning under other policies.
        shard_size: hybrid sharding's group size (ColossalAI's `extra_dp_size` replicas).
        verbose: log the configuration.
        gather_format, reduce_format, quant_block_numel: the wire formats, beyond ColossalAI
            (see `communication_settings` in engine/communication.py).
    """
    if use_fp8:
        raise ValueError(
            f"{caller}(use_fp8={use_fp8!r}) cannot be honoured: shardwise does not compute in "
            f"fp8; leave it False and use precision 'bf16' or 'fp16' (fp8_communication=True "
            f"gathers parameters and reduces gradients in fp8)"
        )
    communication = communication_settings(
        gather_format=gather_format,
        reduce_format=reduce_format,
        quant_block_numel=quant_block_numel,
        fp8_communication=fp8_communication,
        caller=caller,
    )
    if memstats is not None:
        raise ValueError(
            f"{caller}: memstats cannot be honoured: the engine records the order chunks are "
            f"used in during its first iteration itself; leave memstats None"
        )
    if not master_weights:
        raise ValueError(
            f"{caller}: master_weights=False cannot be honoured: the engine always steps fp32 "
            f"master weights; leave it True"
        )
    if placement_policy_name not in GEMINI_PLACEMENTS:
        raise ValueError(
            f"{caller}: placement_policy must be one of {GEMINI_PLACEMENTS}, "
            f"got {placement_policy_name!r}"
        )
    _check_auto_only(caller, placement_policy_name, warmup_non_model_data_ratio)
    if not 0 < steady_cuda_cap_ratio <= 1:
        raise ValueError(
            f"{caller}: steady_cuda_cap_ratio must be in (0, 1], got {steady_cuda_cap_ratio}"
        )
    if isinstance(max_prefetch, bool) or not isinstance(max_prefetch, int) or max_prefetch < 0:
        raise ValueError(f"{caller}: max_prefetch must be an int >= 0, got {max_prefetch!r}")
    if not isinstance(strict_ddp_mode, bool):
        raise TypeError(f"{caller}: strict_ddp_mode must be a bool, got {strict_ddp_mode!r}")
    device = _compute_device(chunk_init_device)
    precision = storage_precision(mixed_precision, device)
    element = torch.empty((), dtype=precision.param_dtype).element_size()
    chunking = Chunking(
        search_range_bytes=round(search_range_m * 2**20) * element,
        min_chunk_bytes=round(min_chunk_size_m * 2**20) * element,
        hidden_dim=hidden_dim,
    )
    keep_gathered = False
    if chunk_config_dict is not None:
        size, keep_gathered = _given_chunk_size(
            caller, chunk_config_dict, comm.world_size(process_group), shard_size
        )
        chunking = Chunking(size_numel=size)
    placement = _placement(
        caller,
        placement_policy_name,
        device,
        shard_param_frac=shard_param_frac,
        offload_optim_frac=offload_optim_frac,
        offload_param_frac=offload_param_frac,
        steady_cuda_cap_ratio=steady_cuda_cap_ratio,
        gpu_margin_mem_ratio=gpu_margin_mem_ratio,
        pin_memory=pin_memory,
        replicate=strict_ddp_mode or keep_gathered,
    )
    config = EngineConfig(
        stage=3,
        device=device,
        precision=precision,
        chunking=chunking,
        placement=placement,
        overlap=Overlap(
            communication=enable_async_reduce,
            prefetch=max_prefetch > 0,
            prefetch_chunks=max(1, max_prefetch),
        ),
        topology=Topology(process_group=process_group, shard_size=shard_size),
        communication=communication,
        force_outputs_fp32=force_outputs_fp32,
    )
    if verbose:
        _log.info("%s: %s", caller, config)
    return config


def _check_auto_only(caller: str, policy: str, warmup_non_model_data_ratio: float) -> None:
    default = AUTO_DEFAULTS["warmup_non_model_data_ratio"]
    if warmup_non_model_data_ratio == default:
        return
    if policy == "auto":
        raise ValueError(
            f"{caller}: warmup_non_model_data_ratio={warmup_non_model_data_ratio} cannot be "
            f"honoured: 'auto' measures the non-model memory of its warm-up step itself; leave "
            f"it at {default}"
        )
    warnings.warn(
        f"{caller}: warmup_non_model_data_ratio={warmup_non_model_data_ratio} is ignored: it "
        f"applies to placement_policy='auto' only, as in ColossalAI",
        UserWarning,
        stacklevel=3,
    )


def _compute_device(chunk_init_device: torch.device | str | None) -> torch.device:
    if chunk_init_device is None:
        return default_device()
    device = torch.device(chunk_init_device)
    # ColossalAI builds chunks there and moves them to the accelerator when used: the engine
    # computes on the accelerator from the start.
    return default_device() if device.type == "cpu" else device


def _given_chunk_size(
    caller: str,
    chunk_config_dict: Mapping[int, Mapping[str, Any]],
    world: int,
    shard_size: int | None,
) -> tuple[int, bool]:
    group = shard_size or world
    if not isinstance(chunk_config_dict, Mapping) or set(chunk_config_dict) != {group}:
        raise ValueError(
            f"{caller}: chunk_config_dict must have one key, the size of the group chunks are "
            f"sharded over ({group}), as search_chunk_configuration returns it; got "
            f"{chunk_config_dict!r}"
        )
    entry = dict(chunk_config_dict[group])
    unknown = sorted(set(entry) - {"chunk_size", "keep_gathered"})
    size = entry.get("chunk_size")
    if unknown or isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"{caller}: chunk_config_dict[{group}] must be {{'chunk_size': <positive int>, "
            f"'keep_gathered': <bool>}}, got {entry!r}"
        )
    keep_gathered = entry.get("keep_gathered", False)
    if not isinstance(keep_gathered, bool):
        raise TypeError(f"{caller}: keep_gathered must be a bool, got {keep_gathered!r}")
    return size, keep_gathered


def _placement(
    caller: str,
    name: str,
    device: torch.device,
    *,
    shard_param_frac: float,
    offload_optim_frac: float,
    offload_param_frac: float,
    steady_cuda_cap_ratio: float,
    gpu_margin_mem_ratio: float,
    pin_memory: bool,
    replicate: bool,
) -> Placement:
    fractions = {
        "shard_param_frac": shard_param_frac,
        "offload_optim_frac": offload_optim_frac,
        "offload_param_frac": offload_param_frac,
    }
    if name != "static":
        # ColossalAI reads the fractions under "static" only.
        ignored = {k: v for k, v in fractions.items() if v != (1.0 if k[0] == "s" else 0.0)}
        if ignored:
            warnings.warn(
                f"{caller}: {ignored} are ignored: they apply to placement_policy='static' "
                f"only, as in ColossalAI (got {name!r})",
                UserWarning,
                stacklevel=3,
            )
        fractions = {}
    margin: float | None = gpu_margin_mem_ratio
    if name != "auto":
        if gpu_margin_mem_ratio:
            warnings.warn(
                f"{caller}: gpu_margin_mem_ratio={gpu_margin_mem_ratio} is ignored: it applies "
                f"to placement_policy='auto' only, as in ColossalAI",
                UserWarning,
                stacklevel=3,
            )
        margin = None
    asked = placement_policy(
        name,
        gpu_margin_mem_ratio=margin,
        shard_param_frac=fractions.get("shard_param_frac", 1.0),
        offload_optim_frac=fractions.get("offload_optim_frac", 0.0),
        offload_param_frac=fractions.get("offload_param_frac", 0.0),
    )
    budget = None
    if name == "auto" and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * steady_cuda_cap_ratio)
    # "auto" without CUDA keeps every chunk on the compute device: see [Note: "auto" without a
    # budget] in gemini/manager.py.
    policy = placement_on(asked, device, budget)
    if replicate:
        policy = replicated(policy)
    return Placement(policy=policy, device_budget_bytes=budget, pin_memory=pin_memory)
