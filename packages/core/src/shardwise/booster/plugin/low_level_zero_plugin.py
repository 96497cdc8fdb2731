"""LowLevelZeroPlugin: ZeRO stages 1 and 2, ColossalAI's `LowLevelZeroPlugin` arguments
translated into one `EngineConfig`."""

from __future__ import annotations

import torch

from shardwise.amp import loss_scale_from
from shardwise.booster.plugin.refusals import precision_of, refuse_model_parallel, shard_size_for
from shardwise.booster.plugin.zero_plugin_base import ZeroPluginBase
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.engine.communication import communication_settings
from shardwise.engine.config import (
    Chunking,
    EngineConfig,
    MixedPrecision,
    Overlap,
    Placement,
    Topology,
)
from shardwise.engine.devices import default_device, pins_host_copies
from shardwise.gemini import placement_policy


class LowLevelZeroPlugin(ZeroPluginBase):
    """ZeRO stage 1 (optimizer state sharded) or 2 (gradients too), with ColossalAI 0.5's
    `LowLevelZeroPlugin` arguments, defaults and order.

    Beyond ColossalAI: `no_sync` at stage 2 too; any `norm_type`; the wire formats by keyword
    (`gather_format`, `reduce_format`, `quant_block_numel`). fp8 compute and
    `master_weights=False` are refused; `fp8_communication=True` gathers parameters and
    reduces gradients in fp8, as ColossalAI's.

    Args (ColossalAI's):
        stage: 1 or 2.
        precision: "fp16", "bf16" or "fp32" (storage and communication; a CPU computes in fp32).
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the fp16 loss scale.
        max_norm, norm_type: gradient clipping in the step (0: none).
        reduce_bucket_size_in_m: millions (2**20) of elements per gradient bucket.
        communication_dtype: the dtype gradients are reduced in (None: the parameters').
        overlap_communication: reduce each bucket in the background of backward (stage 2, and
            stage 1 in fp32, where `.grad` shows the average after backward, as under DDP).
        overlap_allgather: let the all-gather of updated parameters run into the next forward.
        cpu_offload: fp32 masters, reduced gradients and optimizer state in host memory, the
            step on the host (see [Note: offload at stages 1 and 2] in engine/packing.py).
        master_weights, use_fp8: refused unless at their defaults.
        fp8_communication: reduce gradients in fp8 with blockwise scales, and gather the
            updated parameters in fp8 after the step (see [Note: quantized gathers] and
            [Note: quantized reductions] in chunk/wire/formats.py): `gather_format="fp8"`
            and `reduce_format="fp8"`; refused where torch cannot cast to fp8 on the device,
            and beside another format.
        verbose: accepted (overflows are reported by a warning when steps keep being skipped).
        cast_inputs: floating inputs are cast to the compute dtype; False is refused.
        extra_dp_size: replicate the sharded state this many times (hybrid sharding).

    Args (beyond ColossalAI, by keyword):
        gather_format: the parameter all-gathers after the step: "dtype" (the precision's,
            default), "int8" or "fp8" (one byte per value with an fp32 scale per block).
        reduce_format: gradient reductions: "dtype" (`communication_dtype`, default), "int8"
            or "fp8" (an all-to-all of quantized slices summed in fp32 by their owner).
        quant_block_numel: values per quantization block, each with one fp32 scale.
    """

    def __init__(
        self,
        stage: int = 1,
        precision: str = "fp16",
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        reduce_bucket_size_in_m: int = 12,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = True,
        overlap_allgather: bool = False,
        cpu_offload: bool = False,
        master_weights: bool = True,
        verbose: bool = False,
        cast_inputs: bool = True,
        fp8_communication: bool = False,
        use_fp8: bool = False,
        extra_dp_size: int = 1,
        *,
        gather_format: str = "dtype",
        reduce_format: str = "dtype",
        quant_block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        refuse_model_parallel(name, use_fp8=use_fp8)
        self.communication = communication_settings(
            gather_format=gather_format,
            reduce_format=reduce_format,
            quant_block_numel=quant_block_numel,
            fp8_communication=fp8_communication,
            caller=name,
        )
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(
                f"{name}: stage must be 1 or 2 (GeminiPlugin is stage 3), got {stage!r}"
            )
        if not isinstance(cpu_offload, bool):
            raise TypeError(f"{name}: cpu_offload must be a bool, got {cpu_offload!r}")
        if not master_weights:
            raise ValueError(
                f"{name}: master_weights=False cannot be honoured: the engine "
                f"always steps fp32 master weights; leave it True"
            )
        if not cast_inputs:
            raise ValueError(
                f"{name}: cast_inputs=False cannot be honoured: floating inputs are "
                f"cast to the compute dtype"
            )
        self.stage = stage
        self.device = default_device()
        self.placement = Placement(
            policy=placement_policy("cpu" if cpu_offload else "cuda"),
            pin_memory=pins_host_copies(self.device),
        )
        dtypes = precision_of(name, precision, self.device)
        self.precision = MixedPrecision(
            param_dtype=dtypes.param_dtype,
            compute_dtype=dtypes.compute_dtype,
            reduce_dtype=communication_dtype,
        )
        self.chunking = Chunking(size_numel=round(reduce_bucket_size_in_m * 2**20))
        self.overlap = Overlap(communication=overlap_communication, param_gather=overlap_allgather)
        self.topology = Topology(shard_size=shard_size_for(name, extra_dp_size, self.world_size))
        self.loss_scale = loss_scale_from(LowLevelZeroPlugin.__init__, locals())
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.verbose = verbose

    def engine_config(self) -> EngineConfig:
        """The plugin's arguments as the engine's configuration."""
        return EngineConfig(
            stage=self.stage,
            device=self.device,
            precision=self.precision,
            chunking=self.chunking,
            placement=self.placement,
            overlap=self.overlap,
            topology=self.topology,
            communication=self.communication,
        )
