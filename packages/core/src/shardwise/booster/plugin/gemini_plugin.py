"""GeminiPlugin: ZeRO stage 3 with chunk placement, ColossalAI's `GeminiPlugin` arguments
translated into one `EngineConfig`."""

from __future__ import annotations

from typing import Any

import torch

from shardwise.amp import loss_scale_from
from shardwise.booster.plugin.refusals import PRECISIONS, shard_size_for
from shardwise.booster.plugin.shardformer_flags import accept_shardformer_flags
from shardwise.booster.plugin.zero_plugin_base import ZeroPluginBase
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.engine.config import EngineConfig
from shardwise.engine.model import ZeroModel
from shardwise.gemini import AutoPlacement
from shardwise.zero import GeminiOptimizer
from shardwise.zero.gemini_config import gemini_engine_config


class GeminiPlugin(ZeroPluginBase):
    """ZeRO stage 3 (parameters, gradients and optimizer state sharded in chunks), with
    ColossalAI 0.5's `GeminiPlugin` arguments, defaults and order.

    Beyond ColossalAI: `precision="fp32"`; the legacy placements "cuda" (every chunk on the
    compute device) and "cpu" (shards and optimizer state in host memory); `no_sync` at stage
    3; any elementwise torch optimizer (not only HybridAdam); `clip_grad_by_norm` clips; the
    wire formats by keyword (`gather_format`, `reduce_format`, `quant_block_numel`).
    "auto" sizes its budget as `steady_cuda_cap_ratio` of the CUDA device; on a host without
    one it keeps every chunk on the compute device. Arguments ColossalAI ignores at the
    configuration given are accepted and named in a warning or a log line (see
    zero/gemini_config.py); tensor parallelism, fp8 compute and NVMe offload are refused;
    `fp8_communication=True` gathers parameters and reduces gradients in fp8, as ColossalAI's.

    Args (ColossalAI's):
        chunk_config_dict: `{group size: {"chunk_size": n, "keep_gathered": b}}`
            (`search_chunk_configuration`'s), or None to search the size with
            `search_range_m`, `min_chunk_size_m` and `hidden_dim`.
        chunk_init_device: where chunks are first built; the engine computes on the
            accelerator (the CPU without one), where ColossalAI moves them.
        placement_policy: "static" (fractions below), "auto", "cuda" or "cpu".
        enable_gradient_accumulation: accepted; gradients accumulate at every setting.
        max_prefetch: 0 gathers each chunk when first used; >= 1 gathers the next chunk of
            the recorded order while the current one computes (one at a time).
        shard_param_frac, offload_optim_frac, offload_param_frac: "static" placement
            (`offload_param_frac` is ignored, with a warning, unless `shard_param_frac` and
            `offload_optim_frac` are both 1.0, as in ColossalAI).
        warmup_non_model_data_ratio: "auto" only (at its default, 0.8; "auto" measures its
            warm-up itself); ignored with a warning under the other policies.
        steady_cuda_cap_ratio: "auto": the share of the CUDA device's memory for model state.
        precision: "fp16", "bf16" or "fp32" (storage and communication; a CPU computes in fp32).
        master_weights: True (the engine always keeps fp32 masters).
        pin_memory: pin host copies of chunks.
        force_outputs_fp32: cast outputs to fp32.
        strict_ddp_mode: keep every parameter replicated on every rank, as ColossalAI
            documents it (`gemini.replicated`: chunks gathered, gradients reduced each
            backward, optimizer state sharded).
        search_range_m, hidden_dim, min_chunk_size_m: the chunk-size search, in millions
            (2**20) of elements.
        memstats: refused unless None.
        gpu_margin_mem_ratio: "auto": share of the device room left after warm-up that
            optimizer state may use; ignored with a warning under the other policies.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the fp16 loss scale.
        max_norm, norm_type: gradient clipping in the step (0: none).
        tp_size: 1 only (no tensor parallelism).
        enable_all_optimization, enable_fused_normalization, enable_flash_attention,
            enable_sequence_parallelism, enable_jit_fused: Shardformer's kernels, which
            ColossalAI applies only with tp_size > 1: accepted, logged once as changing
            nothing.
        use_fp8: refused unless False (no fp8 compute).
        fp8_communication: gather parameters and reduce gradients in fp8 with blockwise
            scales (see [Note: quantized gathers] and [Note: quantized reductions] in
            chunk/wire/formats.py): `gather_format="fp8"` and `reduce_format="fp8"`; refused
            where torch cannot cast to fp8 on the device, and beside another format.
        extra_dp_size: replicate the sharded model this many times (hybrid sharding).
        enable_async_reduce: reduce gradients in the background of backward.
        verbose: log the engine configuration.

    Args (beyond ColossalAI, by keyword):
        gather_format: parameter all-gathers: "dtype" (the precision's, default), "int8" or
            "fp8" (one byte per value with an fp32 scale per block; ZeRO++'s qwZ).
        reduce_format: gradient reductions: "dtype" (default), "int8" or "fp8" (an
            all-to-all of quantized slices summed in fp32 by their owner; ZeRO++'s qgZ).
        quant_block_numel: values per quantization block, each with one fp32 scale.
    """

    def __init__(
        self,
        chunk_config_dict: dict[int, dict[str, Any]] | None = None,
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
        *,
        gather_format: str = "dtype",
        reduce_format: str = "dtype",
        quant_block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        accept_shardformer_flags(
            name,
            tp_size,
            enable_all_optimization=enable_all_optimization,
            enable_fused_normalization=enable_fused_normalization,
            enable_flash_attention=enable_flash_attention,
            enable_sequence_parallelism=enable_sequence_parallelism,
            enable_jit_fused=enable_jit_fused,
        )
        if precision not in PRECISIONS:
            raise ValueError(
                f"{name}: precision must be one of {sorted(PRECISIONS)}, got {precision!r}"
            )
        self.enable_gradient_accumulation = enable_gradient_accumulation
        self.gpu_margin_mem_ratio = gpu_margin_mem_ratio
        self.config = gemini_engine_config(
            name,
            chunk_config_dict=chunk_config_dict,
            chunk_init_device=chunk_init_device,
            placement_policy_name=placement_policy,
            max_prefetch=max_prefetch,
            shard_param_frac=shard_param_frac,
            offload_optim_frac=offload_optim_frac,
            offload_param_frac=offload_param_frac,
            warmup_non_model_data_ratio=warmup_non_model_data_ratio,
            steady_cuda_cap_ratio=steady_cuda_cap_ratio,
            search_range_m=search_range_m,
            hidden_dim=hidden_dim,
            min_chunk_size_m=min_chunk_size_m,
            pin_memory=pin_memory,
            force_outputs_fp32=force_outputs_fp32,
            strict_ddp_mode=strict_ddp_mode,
            mixed_precision=PRECISIONS[precision],
            process_group=None,
            memstats=memstats,
            master_weights=master_weights,
            enable_async_reduce=enable_async_reduce,
            fp8_communication=fp8_communication,
            use_fp8=use_fp8,
            gpu_margin_mem_ratio=gpu_margin_mem_ratio,
            shard_size=shard_size_for(name, extra_dp_size, self.world_size),
            verbose=verbose,
            gather_format=gather_format,
            reduce_format=reduce_format,
            quant_block_numel=quant_block_numel,
        )
        self.device = self.config.device
        self.loss_scale = loss_scale_from(GeminiPlugin.__init__, locals())
        self.max_norm = max_norm
        self.norm_type = norm_type

    def engine_config(self) -> EngineConfig:
        """The plugin's arguments as the engine's configuration."""
        return self.config

    def boost_optimizer(
        self, model: ZeroModel, optimizer: torch.optim.Optimizer
    ) -> GeminiOptimizer:
        """ColossalAI's boosted optimizer here: a `GeminiOptimizer`."""
        # The ratio placed the model already (a warning named it where it does not apply).
        auto = isinstance(self.config.placement.policy, AutoPlacement)
        return GeminiOptimizer(
            optimizer,
            model,
            gpu_margin_mem_ratio=self.gpu_margin_mem_ratio if auto else 0.0,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            loss_scale=self.loss_scale,
        )
