"""GeminiPlugin: ZeRO stage 3 with chunk placement, ColossalAI's `GeminiPlugin` arguments
translated into one `EngineConfig`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from shardwise.amp import LossScaleConfig
from shardwise.booster.plugin.refusals import precision_of, refuse_model_parallel, shard_size_for
from shardwise.booster.plugin.zero_plugin_base import ZeroPluginBase
from shardwise.engine.config import (
    Chunking,
    EngineConfig,
    Overlap,
    Placement,
    Topology,
    default_device,
)
from shardwise.gemini import placement_policy as placement_policy_object
from shardwise.gemini.manager import placement_on

_log = logging.getLogger(__name__)
PLACEMENTS = ("static", "auto", "cuda", "cpu")


class GeminiPlugin(ZeroPluginBase):
    """ZeRO stage 3 (parameters, gradients and optimizer state sharded in chunks), with
    ColossalAI 0.5's `GeminiPlugin` arguments, defaults and order.

    Beyond ColossalAI: `precision="fp32"`; the legacy placements "cuda" (every chunk on the
    compute device) and "cpu" (shards and optimizer state in host memory); `no_sync` at stage
    3; any elementwise torch optimizer (not only HybridAdam); `clip_grad_by_norm` clips.
    "auto" sizes its budget as `steady_cuda_cap_ratio` of the CUDA device; on a host without
    one it keeps every chunk on the compute device. Tensor parallelism, Shardformer's kernels,
    fp8 and NVMe offload are refused.

    Args (ColossalAI's):
        chunk_config_dict: refused unless None (the chunk size is searched with
            `search_range_m`, `min_chunk_size_m` and `hidden_dim`).
        chunk_init_device: the compute device (None: cuda:<current>, or the CPU).
        placement_policy: "static" (fractions below), "auto", "cuda" or "cpu".
        enable_gradient_accumulation: accepted; gradients accumulate at every setting.
        max_prefetch: 0 gathers each chunk when first used; >= 1 gathers the next chunk of
            the recorded order while the current one computes (one at a time).
        shard_param_frac, offload_optim_frac, offload_param_frac: "static" placement.
        warmup_non_model_data_ratio: "auto" only; left at its default (0.8).
        steady_cuda_cap_ratio: "auto": the share of the CUDA device's memory for model state.
        precision: "fp16", "bf16" or "fp32" (storage and communication; a CPU computes in fp32).
        master_weights: True (the engine always keeps fp32 masters).
        pin_memory: pin host copies of chunks.
        force_outputs_fp32: cast outputs to fp32.
        strict_ddp_mode: refused (use TorchDDPPlugin).
        search_range_m, hidden_dim, min_chunk_size_m: the chunk-size search, in millions
            (2**20) of elements.
        memstats: refused unless None.
        gpu_margin_mem_ratio: "auto": share of the device room left after warm-up that
            optimizer state may use.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the fp16 loss scale.
        max_norm, norm_type: gradient clipping in the step (0: none).
        tp_size, enable_all_optimization, enable_fused_normalization, enable_flash_attention,
            enable_sequence_parallelism, enable_jit_fused, use_fp8, fp8_communication:
            refused unless left at their defaults.
        extra_dp_size: replicate the sharded model this many times (hybrid sharding).
        enable_async_reduce: reduce gradients in the background of backward.
        verbose: log the engine configuration.
    """

    def __init__(
        self,
        chunk_config_dict: dict[str, Any] | None = None,
        chunk_init_device: torch.device | None = None,
        placement_policy: str = "static",
        enable_gradient_accumulation: bool = False,
        max_prefetch: int = 0,
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        warmup_non_model_data_ratio: float = 0.8,
        steady_cuda_cap_ratio: float = 0.9,
        precision: str = "fp16",
        master_weights: bool = True,
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        search_range_m: int = 32,
        hidden_dim: int | None = None,
        min_chunk_size_m: float = 32,
        memstats: Any = None,
        gpu_margin_mem_ratio: float = 0.0,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        tp_size: int = 1,
        extra_dp_size: int = 1,
        enable_all_optimization: bool = False,
        enable_fused_normalization: bool = False,
        enable_flash_attention: bool = False,
        enable_sequence_parallelism: bool = False,
        enable_jit_fused: bool = False,
        enable_async_reduce: bool = True,
        use_fp8: bool = False,
        verbose: bool = False,
        fp8_communication: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        refuse_model_parallel(
            name,
            tp_size=tp_size,
            enable_all_optimization=enable_all_optimization,
            enable_fused_normalization=enable_fused_normalization,
            enable_flash_attention=enable_flash_attention,
            enable_sequence_parallelism=enable_sequence_parallelism,
            enable_jit_fused=enable_jit_fused,
            use_fp8=use_fp8,
            fp8_communication=fp8_communication,
        )
        if chunk_config_dict is not None or memstats is not None:
            raise ValueError(
                f"{name}: chunk_config_dict and memstats cannot be honoured: the chunk size is "
                f"searched from search_range_m, min_chunk_size_m and hidden_dim; leave them None"
            )
        if not master_weights:
            raise ValueError(
                f"{name}: master_weights=False cannot be honoured: the engine "
                f"always steps fp32 master weights; leave it True"
            )
        if strict_ddp_mode:
            raise ValueError(
                f"{name}: strict_ddp_mode=True is plain data parallelism: use "
                f"TorchDDPPlugin (or LowLevelZeroPlugin(stage=1))"
            )
        if placement_policy not in PLACEMENTS:
            raise ValueError(
                f"{name}: placement_policy must be one of {PLACEMENTS}, got {placement_policy!r}"
            )
        if warmup_non_model_data_ratio != 0.8:
            raise ValueError(
                f"{name}: warmup_non_model_data_ratio={warmup_non_model_data_ratio} cannot be "
                f"honoured: 'auto' measures the non-model memory of its warm-up step itself"
            )
        if not 0 < steady_cuda_cap_ratio <= 1:
            raise ValueError(
                f"{name}: steady_cuda_cap_ratio must be in (0, 1], got {steady_cuda_cap_ratio}"
            )
        if isinstance(max_prefetch, bool) or not isinstance(max_prefetch, int) or max_prefetch < 0:
            raise ValueError(f"{name}: max_prefetch must be an int >= 0, got {max_prefetch!r}")
        self.device = torch.device(chunk_init_device) if chunk_init_device else default_device()
        self.precision = precision_of(name, precision, self.device)
        element = torch.empty((), dtype=self.precision.param_dtype).element_size()
        self.chunking = Chunking(
            search_range_bytes=round(search_range_m * 2**20) * element,
            min_chunk_bytes=round(min_chunk_size_m * 2**20) * element,
            hidden_dim=hidden_dim,
        )
        self.placement = self._placement(
            placement_policy,
            shard_param_frac,
            offload_optim_frac,
            offload_param_frac,
            steady_cuda_cap_ratio,
            gpu_margin_mem_ratio,
            pin_memory,
        )
        self.overlap = Overlap(communication=enable_async_reduce, prefetch=max_prefetch > 0)
        self.topology = Topology(shard_size=shard_size_for(name, extra_dp_size, self.world_size))
        self.force_outputs_fp32 = force_outputs_fp32
        self.enable_gradient_accumulation = enable_gradient_accumulation
        self.loss_scale = LossScaleConfig(
            initial_scale=initial_scale,
            min_scale=min_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            max_scale=max_scale,
        )
        self.max_norm = max_norm
        self.norm_type = norm_type
        if verbose:
            _log.info("%s: %s", name, self.engine_config())

    def _placement(
        self,
        policy: str,
        shard_param_frac: float,
        offload_optim_frac: float,
        offload_param_frac: float,
        steady_cuda_cap_ratio: float,
        gpu_margin_mem_ratio: float,
        pin_memory: bool,
    ) -> Placement:
        budget = None
        if policy == "auto" and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = int(total * steady_cuda_cap_ratio)
        asked = placement_policy_object(
            policy,
            shard_param_frac=shard_param_frac,
            offload_optim_frac=offload_optim_frac,
            offload_param_frac=offload_param_frac,
            gpu_margin_mem_ratio=gpu_margin_mem_ratio if policy == "auto" else None,
        )
        # "auto" without CUDA keeps every chunk on the compute device: see [Note: "auto"
        # without a budget] in gemini/manager.py.
        return Placement(
            policy=placement_on(asked, self.device, budget),
            device_budget_bytes=budget,
            pin_memory=pin_memory,
        )

    def engine_config(self) -> EngineConfig:
        """The plugin's arguments as the engine's configuration."""
        return EngineConfig(
            stage=3,
            device=self.device,
            precision=self.precision,
            chunking=self.chunking,
            placement=self.placement,
            overlap=self.overlap,
            topology=self.topology,
            force_outputs_fp32=self.force_outputs_fp32,
        )
