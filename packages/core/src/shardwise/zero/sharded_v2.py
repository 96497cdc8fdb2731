"""ShardedModelV2 and ShardedOptimizerV2: the legacy ZeRO-3 API over the same chunk engine.

A shard strategy decides the chunks (one per tensor, or one per module), hence how many
all-gathers a step issues; everything else is GeminiDDP's machinery. A model built inside a
ZeroInitContext is packed one strategy group at a time, so no rank ever holds it whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwise.chunk import ChunkManager
from shardwise.comm import CommStats
from shardwise.gemini import GeminiManager, MemoryTracer
from shardwise.zero.config import (
    MixedPrecision,
    ZeroConfig,
    default_device,
    gradient_reduction_method,
)
from shardwise.zero.init_context import sliced, unslice
from shardwise.zero.model import ZeroModel
from shardwise.zero.optimizer import ZeroOptimizer, grad_scaler_for
from shardwise.zero.shard_strategy import BaseShardStrategy


class ShardedModelV2(ZeroModel):
    """ZeRO-3 over a shard strategy. Use it with `ShardedOptimizerV2`.

    Args:
        module: the model, best built inside `ZeroInitContext` (a model built outside is
            sharded when wrapped, after being whole on every rank once).
        shard_strategy: `TensorShardStrategy` (a chunk, hence an all-gather, per tensor) or
            `BucketTensorShardStrategy` (one per module).
        process_group: the data-parallel group (default: the default group).
        reduce_scatter_process_group: must be None or `process_group`: gradients are
            reduce-scattered over the group the parameters are sharded over.
        reduce_scatter_bucket_size_mb: gradients of consecutive chunks are reduce-scattered
            together until they reach this size.
        fp32_reduce_scatter: reduce gradients in fp32.
        offload_config: None, or {"device": "cpu"} to keep shards and optimizer state in host
            memory (the "cpu" placement).
        gradient_predivide_factor: divide gradients by this before the reduction, and by
            world size / this after.
        use_memory_tracer: sample the non-model memory (saved activations) of every step into
            `memory_trace`.
        reuse_fp16_shard: keep reduced gradients in the 16-bit parameter shard between backward
            and step instead of an fp32 gradient shard (needs 16-bit parameters; gradient
            accumulation is then refused with an error, as the parameters are overwritten).
    """

    def __init__(
        self,
        module: nn.Module,
        shard_strategy: BaseShardStrategy,
        process_group: ProcessGroup | None = None,
        reduce_scatter_process_group: ProcessGroup | None = None,
        reduce_scatter_bucket_size_mb: float = 25,
        fp32_reduce_scatter: bool = False,
        offload_config: Mapping[str, Any] | None = None,
        gradient_predivide_factor: float = 1.0,
        use_memory_tracer: bool = False,
        reuse_fp16_shard: bool = False,
    ) -> None:
        if not isinstance(shard_strategy, BaseShardStrategy):
            raise TypeError(
                f"shard_strategy must be a TensorShardStrategy or BucketTensorShardStrategy, "
                f"got {type(shard_strategy).__name__}"
            )
        if (
            reduce_scatter_process_group is not None
            and reduce_scatter_process_group is not process_group
        ):
            raise ValueError(
                "reduce_scatter_process_group must be None (or process_group itself): gradients "
                "are reduce-scattered over the group the parameters are sharded over"
            )
        if not reduce_scatter_bucket_size_mb >= 0:
            raise ValueError(
                f"reduce_scatter_bucket_size_mb must be >= 0, got {reduce_scatter_bucket_size_mb}"
            )
        placement = _placement(offload_config)
        param_dtype = _param_dtype(module)
        precision = MixedPrecision(
            param_dtype=param_dtype, reduce_dtype=torch.float32 if fp32_reduce_scatter else None
        )
        device = default_device()
        config = ZeroConfig(
            stage=3,
            device=device,
            mixed_precision=precision,
            chunk_size_numel=1,
            process_group=process_group,
            reduce_scatter_bucket_bytes=int(reduce_scatter_bucket_size_mb * 2**20),
        )
        self.shard_strategy = shard_strategy
        chunk_manager = ChunkManager(
            chunk_size_numel=1,
            device=device,
            dtypes=precision.chunk_dtypes(),
            group=process_group,
            stats=CommStats(),
            predivide_factor=gradient_predivide_factor,
            reduce_method=gradient_reduction_method("auto", process_group),
        )
        super().__init__(module, config, chunk_manager, GeminiManager(placement, chunk_manager))
        self.reuse_fp16_shard = reuse_fp16_shard
        if reuse_fp16_shard:
            for chunk in self.chunk_manager.trainable_chunks():
                chunk.reuse_payload_for_grads()
        self.memory_trace: list[int] = []
        self._tracer = (
            MemoryTracer(device, lambda: self.gemini_manager.memory_by_pool()["device"])  # type: ignore[union-attr]
            if use_memory_tracer
            else None
        )

    def _register_parameters(self, chunk_manager: ChunkManager, sharded_fraction: float) -> None:
        """One strategy group at a time: made whole (if built sliced), packed, sharded."""
        for group in self.shard_strategy.groups(self.module):
            for _, param in group:
                if sliced(param):
                    unslice(param, self.comm_stats, self.config.process_group)
            chunk_manager.chunk_size_numel = max(1, sum(p.numel() for _, p in group))
            chunk_manager.register(group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._tracer is None:
            return super().forward(*args, **kwargs)
        self._tracer.start()
        try:
            output = super().forward(*args, **kwargs)
        finally:
            self._tracer.stop()
        self.memory_trace.append(self._tracer.sample())
        return output


class ShardedOptimizerV2(ZeroOptimizer):
    """The optimizer of a `ShardedModelV2`: sharded fp32 masters, loss scaling, clipping.

    Args:
        sharded_model: the ShardedModelV2.
        optimizer: an elementwise torch optimizer over its parameters, not yet stepped.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the DynamicGradScaler's settings (used when parameters are fp16).
        max_norm: clip the global gradient norm to this; 0 disables clipping.
        norm_type: the clipping norm.
    """

    def __init__(
        self,
        sharded_model: ShardedModelV2,
        optimizer: torch.optim.Optimizer,
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
    ) -> None:
        if not isinstance(sharded_model, ShardedModelV2):
            raise TypeError(
                f"sharded_model must be a ShardedModelV2, got {type(sharded_model).__name__}"
            )
        scaler = grad_scaler_for(
            sharded_model,
            initial_scale=initial_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
        )
        super().__init__(
            sharded_model, optimizer, grad_scaler=scaler, max_norm=max_norm, norm_type=norm_type
        )


def _placement(offload_config: Mapping[str, Any] | None) -> str:
    if offload_config is None:
        return "cuda"
    if not isinstance(offload_config, Mapping) or set(offload_config) != {"device"}:
        raise ValueError(
            f"offload_config must be None or {{'device': 'cpu'}}, got {offload_config!r}"
        )
    if offload_config["device"] != "cpu":
        raise ValueError(
            f"offload_config supports only {{'device': 'cpu'}}, got {offload_config!r}"
        )
    return "cpu"


def _param_dtype(module: nn.Module) -> torch.dtype:
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(dtypes) > 1:
        raise ValueError(
            f"parameters have several dtypes {sorted(map(str, dtypes))}; build the model in one "
            f"(ZeroInitContext(default_dtype=...))"
        )
    return dtypes.pop() if dtypes else torch.float32
