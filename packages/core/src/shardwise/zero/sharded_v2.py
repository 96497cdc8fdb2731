"""ShardedModelV2 and ShardedOptimizerV2: the legacy ZeRO-3 API over the same chunk engine.

A shard strategy decides the chunks (one per tensor, or one per module), hence how many
all-gathers a step issues; everything else is GeminiDDP's machinery. A model built inside a
ZeroInitContext is packed one strategy group at a time, so no rank ever holds it whole.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from shardwise import telemetry
from shardwise.amp import loss_scale_from
from shardwise.chunk import ChunkManager, Pool
from shardwise.chunk.manager import ChunkPlacer, place_packed
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.engine.communication import communication_settings
from shardwise.engine.config import (
    Chunking,
    EngineConfig,
    MixedPrecision,
    Placement,
    Reduction,
    Topology,
)
from shardwise.engine.devices import default_device
from shardwise.engine.model import ZeroModel
from shardwise.engine.optimizer import ZeroOptimizer, grad_scaler_for
from shardwise.engine.wrap import model_parts
from shardwise.gemini import MemoryTracer, placement_policy
from shardwise.prepare.ignore import is_ignored
from shardwise.prepare.slicing import sliced, unslice
from shardwise.zero.shard_strategy import BaseShardStrategy

_logger = logging.getLogger("shardwise.sharded_v2")


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
        gather_format: (keyword only, shardwise's) parameter all-gathers: "dtype" (the
            parameters' dtype, default), "int8" or "fp8" (one byte per value with an fp32
            scale per block; see [Note: quantized gathers] in chunk/wire/formats.py).
        reduce_format: (keyword only) gradient reduce-scatters: "dtype" (default, or fp32
            with `fp32_reduce_scatter`), "int8" or "fp8" (an all-to-all of quantized slices
            summed in fp32 by their owner; see [Note: quantized reductions]).
        quant_block_numel: (keyword only) values per quantization block, each with one fp32
            scale.
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
        *,
        gather_format: str = "dtype",
        reduce_format: str = "dtype",
        quant_block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL,
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
        ignored = [name for name, p in module.named_parameters() if is_ignored(p)]
        if ignored:
            raise ValueError(
                f"parameters {ignored[:5]} are marked by set_params_to_ignore, which "
                f"ShardedModelV2 does not support (it shards every parameter, as ColossalAI's "
                f"does); use "
                f"GeminiDDP / zero_model_wrapper(zero_stage=3) or ColoDDP for ignored parameters"
            )
        placement = placement_policy(_placement(offload_config))
        param_dtype = _param_dtype(module)
        precision = MixedPrecision(
            param_dtype=param_dtype, reduce_dtype=torch.float32 if fp32_reduce_scatter else None
        )
        device = default_device()
        config = EngineConfig(
            stage=3,
            device=device,
            precision=precision,
            # Each strategy group gets a chunk of its own size (see _register_parameters).
            chunking=Chunking(size_numel=1),
            placement=Placement(policy=placement),
            reduction=Reduction(
                bucket_bytes=int(reduce_scatter_bucket_size_mb * 2**20),
                predivide_factor=gradient_predivide_factor,
            ),
            topology=Topology(process_group=process_group),
            communication=communication_settings(
                gather_format=gather_format,
                reduce_format=reduce_format,
                quant_block_numel=quant_block_numel,
                caller=type(self).__name__,
            ),
        )
        self.shard_strategy = shard_strategy
        super().__init__(module, *model_parts(module, config))
        self.reuse_fp16_shard = reuse_fp16_shard
        if reuse_fp16_shard:
            for chunk in self.chunk_manager.trainable_chunks():
                chunk.reuse_payload_for_grads()
        self.offload_config = dict(offload_config) if offload_config is not None else None
        self.use_memory_tracer = use_memory_tracer
        self.memory_trace: list[int] = []
        self._tracer = (
            MemoryTracer(device, lambda: self.gemini_manager.memory_by_pool()["device"])  # type: ignore[union-attr]
            if use_memory_tracer
            else None
        )

    def _register_parameters(
        self,
        chunk_manager: ChunkManager,
        sharded_fraction: float,
        *,
        values_agree: bool,
        placer: ChunkPlacer | None,
    ) -> None:
        """One strategy group at a time: made whole (if built sliced), packed, sharded; then
        placed, every group's chunks planned together."""
        for group in self.shard_strategy.groups(self.module):
            for _, param in group:
                if sliced(param):
                    unslice(param, self.comm_stats, self.config.topology.process_group)
            chunk_manager.chunk_size_numel = max(1, sum(p.numel() for _, p in group))
            chunk_manager.register(group, values_agree=values_agree)
        if placer is not None:
            place_packed(chunk_manager.chunks, placer)

    @property
    def cpu_offload(self) -> bool:
        """Whether shards and optimizer state live in host memory (`offload_config`)."""
        return self.offload_config is not None

    def state_dict(  # type: ignore[override]
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        only_rank_0: bool = False,
    ) -> dict[str, Any]:
        """The whole model state on every rank by default, as ColossalAI's ShardedModelV2
        returns it; `only_rank_0=True` keeps it on rank 0 only (the others get an empty dict).
        A collective: every rank must call it. See `GeminiDDP.state_dict` for the contents."""
        return super().state_dict(destination, prefix, keep_vars, only_rank_0=only_rank_0)

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

    It takes ColossalAI's signature, positional order included; every argument has its meaning
    or is refused when set to a value that cannot be honoured.

    Args:
        sharded_model: the ShardedModelV2.
        optimizer: an elementwise torch optimizer over its parameters, not yet stepped.
        gpu_margin_mem_ratio: in [0, 1]. As in ColossalAI: when the model keeps optimizer state
            in host memory (`offload_config={"device": "cpu"}`), this share of the device room
            left after the first forward and backward is given to the fp32 optimizer side of
            chunks (master, gradient shard and optimizer state, chunk by chunk in chunk order),
            which then step on the device. The room is the device budget
            (`sharded_model.gemini_manager.device_budget_bytes`: on CUDA the device's capacity
            less 10%) less the peak of model state on the device and of the non-model memory
            traced by `use_memory_tracer=True`, both of which it therefore needs. 0 (the
            default) keeps everything where the model put it. ColossalAI ignores a ratio it
            cannot use; here it is refused.
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the DynamicGradScaler's settings (used when parameters are fp16).
        dp_process_group: the data-parallel group: None or the model's own process group (the
            group its parameters are sharded over); any other group is refused.
        mp_process_group: a model-parallel group; shardwise has no model parallelism, so only
            None is accepted.
        verbose: log the model's and the optimizer's memory (logger "shardwise.sharded_v2", at
            DEBUG) before and after every step, as ColossalAI's verbose mode does.
        max_norm: (keyword only, shardwise's) clip the global gradient norm to this; 0
            disables clipping.
        norm_type: (keyword only) the clipping norm.
    """

    def __init__(
        self,
        sharded_model: ShardedModelV2,
        optimizer: torch.optim.Optimizer,
        gpu_margin_mem_ratio: float = 0.0,
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        dp_process_group: ProcessGroup | None = None,
        mp_process_group: ProcessGroup | None = None,
        verbose: bool = False,
        *,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
    ) -> None:
        if not isinstance(sharded_model, ShardedModelV2):
            raise TypeError(
                f"sharded_model must be a ShardedModelV2, got {type(sharded_model).__name__}"
            )
        if isinstance(optimizer, ShardedOptimizerV2):
            raise TypeError("optimizer is already a ShardedOptimizerV2; pass the inner optimizer")
        _check_margin_ratio(sharded_model, gpu_margin_mem_ratio)
        own_group = sharded_model.config.topology.process_group
        if dp_process_group not in (None, own_group) and not (
            own_group is None and dp_process_group is dist.group.WORLD
        ):
            raise ValueError(
                "dp_process_group must be None or the ShardedModelV2's process_group: the "
                "optimizer steps the shards the model's group holds"
            )
        if mp_process_group is not None:
            raise ValueError(
                "mp_process_group must be None: shardwise has no model (tensor) parallelism, so "
                "there is no model-parallel group to check for overflow over"
            )
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be a bool, got {verbose!r}")
        scaler = grad_scaler_for(
            sharded_model, loss_scale_from(ShardedOptimizerV2.__init__, locals())
        )
        super().__init__(
            sharded_model, optimizer, grad_scaler=scaler, max_norm=max_norm, norm_type=norm_type
        )
        self.gpu_margin_mem_ratio = float(gpu_margin_mem_ratio)
        self.verbose = verbose
        self._margin_pending = self.gpu_margin_mem_ratio > 0
        self.chunks_moved_to_device = 0
        # Streams when the environment says where.
        telemetry.enable(sharded_model, self, entry_point="ShardedOptimizerV2")

    def step(self) -> bool:
        """See `ZeroOptimizer.step`; the first step first fills the device margin (see
        `gpu_margin_mem_ratio`)."""
        if self._margin_pending:
            self._margin_pending = False
            self._fill_device_margin()
        if self.verbose:
            self._log_memory("before step")
        taken = super().step()
        if self.verbose:
            self._log_memory("after step")
        return taken

    def _fill_device_margin(self) -> None:
        """Move optimizer sides of chunks to the device within `gpu_margin_mem_ratio` of the
        room the first forward and backward left (as ColossalAI's ShardedOptimizerV2 does)."""
        model = self.model
        assert isinstance(model, ShardedModelV2) and model.gemini_manager is not None
        gemini = model.gemini_manager
        budget = gemini.device_budget_bytes
        assert budget is not None  # checked at construction
        peak = gemini.peak_device_bytes + max(model.memory_trace, default=0)
        margin = int(self.gpu_margin_mem_ratio * max(0, budget - peak))
        for chunk in self._chunks:
            if chunk.placement.optim is Pool.DEVICE:
                continue
            # fp32 master and gradient shard, and the optimizer's state (or, before the first
            # step creates it, two fp32 values per element, as Adam keeps).
            state = self.chunk_state_bytes(chunk) or chunk.master.numel() * 8
            side = chunk.master.numel() * 4 * 2 + state
            if side > margin:
                break
            margin -= side
            chunk.move_optim(Pool.DEVICE)
            self.chunks_moved_to_device += 1

    def _log_memory(self, when: str) -> None:
        model = self.model.memory_report()
        _logger.debug(
            "ShardedOptimizerV2 %s: model state %s bytes, optimizer state %d bytes",
            when,
            model,
            self.state_bytes(),
        )


def _check_margin_ratio(model: ShardedModelV2, ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ValueError(f"gpu_margin_mem_ratio must be a number in [0, 1], got {ratio!r}")
    if ratio == 0:
        return
    if not model.cpu_offload:
        raise ValueError(
            f"gpu_margin_mem_ratio={ratio} has no meaning here: without offload_config the "
            f"optimizer state is on the device already; build ShardedModelV2 with "
            f"offload_config={{'device': 'cpu'}}, or leave gpu_margin_mem_ratio=0.0"
        )
    if not model.use_memory_tracer:
        raise ValueError(
            f"gpu_margin_mem_ratio={ratio} needs the non-model memory of a step, traced by "
            f"ShardedModelV2(..., use_memory_tracer=True) (ColossalAI's needs its memory tracer "
            f"too)"
        )
    assert model.gemini_manager is not None
    if model.gemini_manager.device_budget_bytes is None:
        raise ValueError(
            f"gpu_margin_mem_ratio={ratio} needs the device's capacity, and {model.config.device} "
            f"has none: set sharded_model.gemini_manager.device_budget_bytes (bytes) first"
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
