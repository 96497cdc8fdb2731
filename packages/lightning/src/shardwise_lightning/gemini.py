"""GeminiStrategy: the arguments of Lightning's former ColossalAIStrategy over shardwise."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.plugins.precision import Precision
from torch.distributed.constants import default_pg_timeout

from shardwise import Chunking, EngineConfig, Placement
from shardwise.amp import LossScaleConfig, loss_scale_from
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.engine.refine import Parts, defaults_of, translated
from shardwise.gemini import placement_policy as placement_policy_object
from shardwise_lightning.base import ShardwiseStrategyBase


class GeminiStrategy(ShardwiseStrategyBase):
    """ZeRO stage 3 with chunk placement by the Gemini memory manager.

    Parameters, gradients and optimizer state are sharded in chunks over the ranks; each chunk
    is gathered just before the modules that use it run and released after. Any elementwise
    optimizer from `configure_optimizers` works (HybridAdam is the fast one), with LR
    schedulers, `accumulate_grad_batches`, `gradient_clip_val` (global norm, clipped by the
    engine) and precision "32-true", "16-mixed" or "bf16-mixed". Models built in
    `configure_model` are sharded as they are built.

    Args:
        use_chunk: pack many tensors per chunk; False gives every tensor a chunk of its own.
        chunk_size: elements per chunk; None searches one with `chunk_search_range`,
            `chunk_search_n_grids` and `min_chunk_size`.
        enable_distributed_storage: shard parameters (1/N per rank); False keeps every chunk
            gathered on the compute device and shards only gradients and optimizer state.
        placement_policy: "cuda" (alias "device": everything on the compute device, fastest,
            also the right choice on a CPU host), "cpu" (shards and optimizer state in host
            memory), "auto" (the default: moved under a device budget, the CUDA device's
            capacity unless `device_budget_bytes` is given; without CUDA and without a budget
            every chunk stays on the compute device, as "cuda"), or "static" (fixed fractions,
            see below).
        force_outputs_fp32: cast the model's floating-point outputs to fp32.
        gpu_margin_mem_ratio: "auto" only: share of the device room left after warm-up that
            optimizer state may use.
        chunk_search_range, chunk_search_n_grids, min_chunk_size: the chunk-size search, in
            bytes of the parameter dtype and grid steps.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the dynamic loss scale, used with "16-mixed".
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for Lightning's DDPStrategy.
        device_budget_bytes: "auto": bytes of model state the compute device may hold (None:
            the CUDA device's capacity less 10%; no budget elsewhere).
        shard_param_frac, offload_optim_frac, offload_param_frac: "static": the share of
            chunks sharded, and of optimizer sides and shards kept in host memory.
        process_group_backend, timeout: as for Lightning's DDPStrategy.
        state_dict_type: what `trainer.save_checkpoint` (and so `ModelCheckpoint`) writes:
            "full" (the default, as for Lightning's FSDPStrategy: one `.ckpt` file from rank 0
            that `LightningModule.load_from_checkpoint`, `torch.load` and other strategies
            read) or "sharded" (a directory, every rank its shards, loadable at any world size,
            no rank holding the whole state).
        shard_size: hybrid sharding: shard over groups of this many consecutive ranks (e.g.
            the devices of one node) and replicate across the groups; None shards over all.
        secondary_shard_size: ZeRO++ hpZ: keep a secondary copy of each chunk sharded over
            groups of this many consecutive ranks from forward to backward, whose gathers then
            stay inside a group; 1 keeps each rank's whole copy (no gather in backward); None:
            backward gathers over every rank.
        gather_format: parameter all-gathers: "dtype" (the precision's, default), "int8" or
            "fp8" (ZeRO++'s qwZ: one byte per value with an fp32 scale per block; each rank
            keeps its own slice and its fp32 masters exact).
        reduce_format: gradient reductions: "dtype" (default), "int8" or "fp8" (ZeRO++'s qgZ:
            an all-to-all of quantized slices, summed in fp32 by their owner).
        quant_block_numel: values per quantization block, each with one fp32 scale.
        engine_config: the engine's whole configuration (`shardwise.EngineConfig`, stage 3),
            every setting of the engine among it: the disk tier, `host_buffer_pool`,
            `gather_units`, the prefetch settings, ... The other arguments refine it: one left
            at its default keeps engine_config's value, one given another value replaces the
            settings it stands for (see [Note: engine_config and the arguments that refine
            it] in shardwise/engine/refine.py). Its device must be of the Trainer's device
            type (each rank computes on its own); its precision, unless left at its default,
            must store in the Trainer's precision. None: the strategy's own defaults.
        loss_scale: the seven loss-scale settings as one `shardwise.amp.LossScaleConfig`,
            which the separate ones refine (one left at its default keeps loss_scale's value).
    """

    def __init__(
        self,
        use_chunk: bool = True,
        chunk_size: int | None = None,
        enable_distributed_storage: bool = True,
        placement_policy: str = "auto",
        force_outputs_fp32: bool = False,
        gpu_margin_mem_ratio: float = 0.0,
        chunk_search_range: int = 64 * 1024**2,
        chunk_search_n_grids: int = 4096,
        min_chunk_size: int = 32 * 1024**2,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        device_budget_bytes: int | None = None,
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        process_group_backend: str | None = None,
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
        # Every argument by name, for the translations into the engine's settings and the loss
        # scale.
        arguments = locals()
        super().__init__(
            loss_scale=loss_scale_from(GeminiStrategy.__init__, arguments, loss_scale),
            asked=translated(_gemini_parts, arguments),
            defaults=translated(_gemini_parts, defaults_of(GeminiStrategy.__init__)),
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

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register "shardwise_gemini" (chunks on the compute device), "shardwise_gemini_offload"
        (in host memory) and "shardwise_gemini_auto" (moved under the CUDA device's capacity;
        on the compute device without CUDA)."""
        strategy_registry.register(
            "shardwise_gemini",
            cls,
            override=True,
            description="shardwise ZeRO-3 (Gemini), chunks on the compute device",
            placement_policy="cuda",
        )
        strategy_registry.register(
            "shardwise_gemini_offload",
            cls,
            override=True,
            description="shardwise ZeRO-3 (Gemini), shards and optimizer state in host memory",
            placement_policy="cpu",
        )
        strategy_registry.register(
            "shardwise_gemini_auto",
            cls,
            override=True,
            description=(
                "shardwise ZeRO-3 (Gemini), chunks moved under the CUDA device's capacity (kept "
                "on the compute device without CUDA)"
            ),
            placement_policy="auto",
        )


def _gemini_parts(
    use_chunk: bool,
    chunk_size: int | None,
    enable_distributed_storage: bool,
    placement_policy: str,
    force_outputs_fp32: bool,
    gpu_margin_mem_ratio: float,
    chunk_search_range: int,
    chunk_search_n_grids: int,
    min_chunk_size: int,
    device_budget_bytes: int | None,
    shard_param_frac: float,
    offload_optim_frac: float,
    offload_param_frac: float,
) -> Parts:
    """GeminiStrategy's arguments as the engine's settings; each part validates its values
    as it is built (named as our arguments)."""
    for name, value in (
        ("use_chunk", use_chunk),
        ("enable_distributed_storage", enable_distributed_storage),
        ("force_outputs_fp32", force_outputs_fp32),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if chunk_size is not None:
        if not use_chunk:
            raise ValueError(
                f"chunk_size={chunk_size} has no meaning with use_chunk=False (every tensor "
                f"gets a chunk of its own); drop one of them"
            )
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int (elements), got {chunk_size!r}")
    chunking = (
        Chunking(size_numel=1)  # capacity 1: each tensor alone
        if not use_chunk
        else Chunking(size_numel=chunk_size)
        if chunk_size is not None
        else Chunking(
            search_range_bytes=chunk_search_range,
            search_n_grids=chunk_search_n_grids,
            min_chunk_bytes=min_chunk_size,
        )
    )
    if not enable_distributed_storage:
        _check_unsharded(placement_policy, shard_param_frac, offload_param_frac)
        placement_policy, shard_param_frac = "static", 0.0
    policy = placement_policy_object(
        placement_policy,
        shard_param_frac=shard_param_frac,
        offload_optim_frac=offload_optim_frac,
        offload_param_frac=offload_param_frac,
        gpu_margin_mem_ratio=gpu_margin_mem_ratio,
    )
    return {
        "chunking": chunking,
        # "auto" is resolved on the device the chunks will live on (see [Note: "auto" without
        # a budget] in shardwise/gemini/manager.py).
        "placement": Placement(policy=policy, device_budget_bytes=device_budget_bytes),
        "force_outputs_fp32": force_outputs_fp32,
    }


def _check_unsharded(policy: str, shard_param_frac: float, offload_param_frac: float) -> None:
    """enable_distributed_storage=False: every chunk stays gathered on the compute device,
    which is the "static" policy sharding none."""
    if policy not in ("cuda", "device", "static"):
        raise ValueError(
            f"enable_distributed_storage=False keeps every chunk gathered on the compute device, "
            f"which placement_policy={policy!r} cannot do; use 'cuda' or 'static'"
        )
    if shard_param_frac != 1.0 or offload_param_frac != 0.0:
        raise ValueError(
            "enable_distributed_storage=False already decides shard_param_frac (0) and "
            "offload_param_frac (0); leave them at their defaults"
        )
