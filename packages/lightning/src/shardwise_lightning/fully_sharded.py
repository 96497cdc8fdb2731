"""FullyShardedStrategy: the arguments of Lightning's former DDPFullyShardedStrategy over
shardwise."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.plugins.precision import Precision
from torch.distributed.constants import default_pg_timeout

from shardwise import Chunking, EngineConfig, MixedPrecision, Placement, Reduction
from shardwise.amp import LossScaleConfig, loss_scale_from
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.engine.refine import Parts, defaults_of, translated
from shardwise.gemini import placement_policy
from shardwise_lightning.base import ShardwiseStrategyBase


class FullyShardedStrategy(ShardwiseStrategyBase):
    """Fully sharded data parallelism (ZeRO stage 3) on the shardwise chunk engine.

    A "wrapped unit" of the original is a chunk here: parameters are packed, in module order,
    into flat chunks (of `min_num_params` elements when given, else of the size the engine's
    chunk search picks, as for GeminiStrategy); a chunk is all-gathered before the modules that
    use it run and resharded after, and its gradients are reduced into shards.

    Args:
        accelerator: as for Lightning's DDPStrategy.
        cpu_offload: keep parameter shards, fp32 masters, gradients and optimizer state in host
            memory (the step runs on the CPU); any precision.
        flatten_parameters: must be True: chunks are always flat buffers.
        reshard_after_forward: must be True: a chunk is released after its last use in forward
            and gathered again for backward.
        move_grads_to_cpu: None follows `cpu_offload`; gradient shards live with the fp32
            masters, so any other value than `cpu_offload` is refused.
        fp32_reduce_scatter: reduce gradients in fp32 (in mixed precision; None: in the
            parameter dtype).
        compute_dtype: dtype of gathered parameters and the forward/backward math; None: the
            16-bit dtype in mixed precision on CUDA, fp32 otherwise (16-bit math is slow on CPUs).
        bucket_cap_mb: gradients of consecutive chunks are reduced together up to this many MB;
            values <= 0 reduce chunk by chunk.
        min_num_params: elements per chunk (the auto-wrap threshold of the original); None
            (the default) searches a size as GeminiStrategy does: the least padding among
            sizes that keep the chunks gathered at once within half the model and the model in
            at least 4 chunks (see shardwise/chunk/search.py). The original's 100M-element
            default put most of a GPT-2 124M in one chunk, gathered whole.
        state_dict_to_cpu: `lightning_module_state_dict` on CPU (True) or the compute device.
        parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend: as for Lightning's DDPStrategy.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the dynamic loss scale, used with "16-mixed".
        timeout: as for Lightning's DDPStrategy.
        state_dict_type, shard_size, secondary_shard_size, gather_format, reduce_format,
            quant_block_numel, engine_config, loss_scale: as for `GeminiStrategy`.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        cpu_offload: bool = False,
        flatten_parameters: bool = True,
        reshard_after_forward: bool = True,
        move_grads_to_cpu: bool | None = None,
        fp32_reduce_scatter: bool | None = None,
        compute_dtype: torch.dtype | None = None,
        bucket_cap_mb: int = 25,
        min_num_params: int | None = None,
        state_dict_to_cpu: bool = True,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        *,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        timeout: timedelta | None = default_pg_timeout,
        state_dict_type: str = "full",
        shard_size: int | None = None,
        secondary_shard_size: int | None = None,
        gather_format: str = "dtype",
        reduce_format: str = "dtype",
        quant_block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL,
        engine_config: EngineConfig | None = None,
        loss_scale: LossScaleConfig | None = None,
    ) -> None:
        for name, value in (
            ("cpu_offload", cpu_offload),
            ("flatten_parameters", flatten_parameters),
            ("reshard_after_forward", reshard_after_forward),
            ("state_dict_to_cpu", state_dict_to_cpu),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if not flatten_parameters:
            raise ValueError(
                "flatten_parameters=False cannot be honoured: the engine keeps parameters in "
                "flat chunks; leave it True"
            )
        if not reshard_after_forward:
            raise ValueError(
                "reshard_after_forward=False cannot be honoured: the engine releases each chunk "
                "after its last use in forward; leave it True"
            )
        if move_grads_to_cpu is not None and move_grads_to_cpu != cpu_offload:
            raise ValueError(
                f"move_grads_to_cpu={move_grads_to_cpu} with cpu_offload={cpu_offload} cannot "
                f"be honoured: gradient shards live beside the fp32 masters, which cpu_offload "
                f"places; leave move_grads_to_cpu=None"
            )
        # Every argument by name, for the translations into the engine's settings and the loss
        # scale.
        arguments = locals()
        super().__init__(
            loss_scale=loss_scale_from(FullyShardedStrategy.__init__, arguments, loss_scale),
            asked=translated(_fsdp_parts, arguments),
            defaults=translated(_fsdp_parts, defaults_of(FullyShardedStrategy.__init__)),
            engine_config=engine_config,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            state_dict_type=state_dict_type,
            shard_size=shard_size,
            secondary_shard_size=secondary_shard_size,
            gather_format=gather_format,
            reduce_format=reduce_format,
            quant_block_numel=quant_block_numel,
        )
        self.cpu_offload = cpu_offload
        self.state_dict_to_cpu = state_dict_to_cpu

    def state_dict_device(self) -> torch.device:
        return torch.device("cpu") if self.state_dict_to_cpu else self.root_device

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register "shardwise_fsdp" and "shardwise_fsdp_offload" (cpu_offload=True)."""
        strategy_registry.register(
            "shardwise_fsdp",
            cls,
            override=True,
            description="shardwise fully sharded data parallel (ZeRO-3)",
        )
        strategy_registry.register(
            "shardwise_fsdp_offload",
            cls,
            override=True,
            description="shardwise fully sharded data parallel (ZeRO-3) with CPU offload",
            cpu_offload=True,
        )


def _fsdp_parts(
    cpu_offload: bool,
    fp32_reduce_scatter: bool | None,
    compute_dtype: torch.dtype | None,
    bucket_cap_mb: float,
    min_num_params: int | None,
) -> Parts:
    """FullyShardedStrategy's arguments as the engine's settings. The storage dtype is the
    Trainer's precision; these arguments give the compute and reduction dtypes."""
    if fp32_reduce_scatter is not None and not isinstance(fp32_reduce_scatter, bool):
        raise TypeError(f"fp32_reduce_scatter must be a bool or None, got {fp32_reduce_scatter!r}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"bucket_cap_mb must be a number, got {bucket_cap_mb!r}")
    if min_num_params is not None and (
        isinstance(min_num_params, bool)
        or not isinstance(min_num_params, int)
        or min_num_params < 1
    ):
        raise ValueError(
            f"min_num_params must be a positive int or None (searched), got {min_num_params!r}"
        )
    return {
        "precision": MixedPrecision(
            compute_dtype=compute_dtype,
            reduce_dtype=torch.float32 if fp32_reduce_scatter else None,
        ),
        "chunking": Chunking(size_numel=min_num_params),  # None: searched
        "placement": Placement(policy=placement_policy("cpu" if cpu_offload else "cuda")),
        "reduction": Reduction(bucket_bytes=max(0, int(bucket_cap_mb * 2**20))),
    }
