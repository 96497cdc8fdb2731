"""Stage 3 under its seed and ColossalAI names: GeminiDDP / ZeroDDP."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwise import comm
from shardwise.chunk import ChunkManager
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.engine.communication import Communication
from shardwise.engine.config import (
    Chunking,
    EngineConfig,
    MixedPrecision,
    Overlap,
    Placement,
    Reduction,
    Topology,
)
from shardwise.engine.model import ZeroModel
from shardwise.engine.wrap import model_parts
from shardwise.gemini import GeminiManager, replicated
from shardwise.prepare.ignore import mark_ignored
from shardwise.zero.gemini_config import gemini_engine_config


class GeminiDDP(ZeroModel):
    """ZeRO stage 3: parameters, gradients and optimizer state sharded in chunks.

    Each chunk is all-gathered just before the first module that uses it runs (forward and
    backward), released after its last use, and its gradients are reduce-scattered as soon as
    the chunk's last gradient is ready, in the background while backward goes on (one
    reduction in flight: the chunk stays gathered until its reduction is done; the "auto"
    placement policy, which plans every gather against its budget, waits for each). The next chunk
    in the order recorded during the first iteration is prefetched, and the chunks backward
    starts with stay gathered from the end of forward.

    Parameters marked by `GeminiDDP.set_params_to_ignore` before wrapping stay out of the
    chunks: local to each rank, never broadcast, reduced or sharded (see
    `set_params_to_ignore`).

    Two constructors, told apart by the second argument:
    - ColossalAI 0.5's, `GeminiDDP(module, chunk_config_dict=None, chunk_init_device=...,
      placement_policy="static", ...)`, its keywords translated as GeminiPlugin's are (see
      zero/gemini_config.py: `zero_group` is the process group to shard over;
      `mixed_precision` the storage dtype, fp16 by default as there; `max_prefetch` > 0
      prefetches; `enable_gradient_accumulation` and `verbose` are accepted; `extra_dp_group`,
      `scatter_after_inference=False`, `memstats`, fp8 compute (`use_fp8`) and
      `master_weights=False` are refused, with what to use instead; `fp8_communication=True`
      gathers and reduces in fp8);
    - the seeds', `GeminiDDP(module, gemini_manager, pin_memory=False,
      force_outputs_fp32=False, strict_ddp_mode=False)`, whose managers say everything else.

    Args:
        module: the model to shard.
        chunk_config_dict: ColossalAI's chunk configuration (`{group size: {"chunk_size": n,
            "keep_gathered": b}}`, as `search_chunk_configuration` returns it) or None to
            search one; or, for the seeds' constructor, the `GeminiManager` (its chunk
            manager's device, dtypes, chunk size and process group apply).
        pin_memory: pin host copies of chunks.
        force_outputs_fp32: cast floating-point outputs to fp32.
        strict_ddp_mode: keep every parameter replicated on every rank (see
            `gemini.replicated`), as ColossalAI documents it.
        gemini_manager: the seeds' manager, by keyword.
        prefetch: the seeds' constructor: gather the next chunk of the recorded order ahead
            of its use (ColossalAI's takes `max_prefetch`).
        reduce_scatter_bucket_bytes: reduce the gradients of consecutive chunks together until
            they reach this many bytes (0: one reduction per chunk).
        param_init_fn: initialises a module of a model built on the meta device (see
            `EngineConfig`).
        fp8_communication: ColossalAI's: gather parameters and reduce gradients in fp8 with
            blockwise scales, the same as `gather_format="fp8"` and `reduce_format="fp8"`.
        gather_format: parameter all-gathers: "dtype" (`mixed_precision`, default), "int8" or
            "fp8" (one byte per value with an fp32 scale per block; see [Note: quantized
            gathers] in chunk/wire/formats.py).
        reduce_format: gradient reductions: "dtype" (default), "int8" or "fp8" (an
            all-to-all of quantized slices summed in fp32 by their owner; see [Note:
            quantized reductions]).
        quant_block_numel: values per quantization block, each with one fp32 scale.
        The seeds' constructor takes the wire formats from its ChunkManager (`wire=`); the
        settings above must keep their defaults there.
        The other arguments are ColossalAI 0.5's, described in zero/gemini_config.py.
    """

    def __init__(
        self,
        module: nn.Module,
        chunk_config_dict: dict[int, dict[str, Any]] | GeminiManager | None = None,
        chunk_init_device: torch.device | str | None = None,
        placement_policy: str = "static",
        enable_gradient_accumulation: bool = False,
        max_prefetch: int = 0,
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        warmup_non_model_data_ratio: float = 0.8,
        steady_cuda_cap_ratio: float = 0.9,
        search_range_m: int = 32,
        hidden_dim: int | None = None,
        min_chunk_size_m: float = 32,
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        scatter_after_inference: bool = True,
        mixed_precision: torch.dtype = torch.float16,
        zero_group: ProcessGroup | None = None,
        memstats: Any = None,
        master_weights: bool = True,
        extra_dp_group: ProcessGroup | None = None,
        verbose: bool = False,
        enable_async_reduce: bool = True,
        fp8_communication: bool = False,
        use_fp8: bool = False,
        *,
        gemini_manager: GeminiManager | None = None,
        prefetch: bool | None = None,
        reduce_scatter_bucket_bytes: int = 0,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        gather_format: str = "dtype",
        reduce_format: str = "dtype",
        quant_block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL,
    ) -> None:
        if isinstance(chunk_config_dict, GeminiManager):
            if gemini_manager is not None:
                raise TypeError("pass the GeminiManager once (second argument or gemini_manager=)")
            gemini_manager, chunk_config_dict = chunk_config_dict, None
        if gemini_manager is not None:
            _only_seed_arguments(
                chunk_config_dict=(chunk_config_dict, None),
                chunk_init_device=(chunk_init_device, None),
                placement_policy=(placement_policy, "static"),
                enable_gradient_accumulation=(enable_gradient_accumulation, False),
                max_prefetch=(max_prefetch, 0),
                shard_param_frac=(shard_param_frac, 1.0),
                offload_optim_frac=(offload_optim_frac, 0.0),
                offload_param_frac=(offload_param_frac, 0.0),
                warmup_non_model_data_ratio=(warmup_non_model_data_ratio, 0.8),
                steady_cuda_cap_ratio=(steady_cuda_cap_ratio, 0.9),
                search_range_m=(search_range_m, 32),
                hidden_dim=(hidden_dim, None),
                min_chunk_size_m=(min_chunk_size_m, 32),
                scatter_after_inference=(scatter_after_inference, True),
                mixed_precision=(mixed_precision, torch.float16),
                zero_group=(zero_group, None),
                memstats=(memstats, None),
                master_weights=(master_weights, True),
                extra_dp_group=(extra_dp_group, None),
                enable_async_reduce=(enable_async_reduce, True),
                fp8_communication=(fp8_communication, False),
                use_fp8=(use_fp8, False),
                gather_format=(gather_format, "dtype"),
                reduce_format=(reduce_format, "dtype"),
                quant_block_numel=(quant_block_numel, DEFAULT_QUANT_BLOCK_NUMEL),
            )
            config = _seed_config(
                gemini_manager,
                pin_memory=pin_memory,
                force_outputs_fp32=force_outputs_fp32,
                strict_ddp_mode=strict_ddp_mode,
                prefetch=True if prefetch is None else prefetch,
                reduce_scatter_bucket_bytes=reduce_scatter_bucket_bytes,
                param_init_fn=param_init_fn,
            )
            chunk_manager = gemini_manager.chunk_manager
            if strict_ddp_mode:
                gemini_manager = GeminiManager(
                    config.placement.policy,
                    chunk_manager,
                    device_budget_bytes=gemini_manager.device_budget_bytes,
                )
            self._build(module, config, chunk_manager, gemini_manager)
            return
        if prefetch is not None:
            raise ValueError(
                "prefetch= belongs to the GeminiManager constructor; ColossalAI's takes "
                "max_prefetch (0: none, >= 1: prefetch the next chunk)"
            )
        if extra_dp_group is not None:
            raise ValueError(
                "extra_dp_group cannot be honoured here: hybrid sharding replicates over groups "
                "of consecutive ranks it builds itself; use GeminiPlugin(extra_dp_size=...) or "
                "gemini_config={'shard_size': ...}"
            )
        if not scatter_after_inference:
            raise ValueError(
                "scatter_after_inference=False cannot be honoured: chunks are released after "
                "every forward, inference included; leave it True"
            )
        config = gemini_engine_config(
            type(self).__name__,
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
            mixed_precision=mixed_precision,
            process_group=zero_group,
            memstats=memstats,
            master_weights=master_weights,
            enable_async_reduce=enable_async_reduce,
            fp8_communication=fp8_communication,
            use_fp8=use_fp8,
            verbose=verbose,
            gather_format=gather_format,
            reduce_format=reduce_format,
            quant_block_numel=quant_block_numel,
        )
        config = replace(
            config,
            reduction=Reduction(bucket_bytes=reduce_scatter_bucket_bytes),
            param_init_fn=param_init_fn,
        )
        config, built_chunks, built_manager = model_parts(module, config)
        assert built_chunks is not None and built_manager is not None  # stage 3's
        self._build(module, config, built_chunks, built_manager)

    @classmethod
    def from_config(cls, module: nn.Module, config: EngineConfig) -> GeminiDDP:
        """Stage 3 from the engine configuration (`zero_model_wrapper`'s path and the
        adapters'): the chunk size settled, the managers built from it (engine/build.py)."""
        config, chunk_manager, gemini_manager = model_parts(module, config)
        assert chunk_manager is not None and gemini_manager is not None  # stage 3's
        model = cls.__new__(cls)
        model._build(module, config, chunk_manager, gemini_manager)
        return model

    def _build(
        self,
        module: nn.Module,
        config: EngineConfig,
        chunk_manager: ChunkManager,
        gemini_manager: GeminiManager,
    ) -> None:
        self.pin_memory = config.placement.pin_memory
        ZeroModel.__init__(self, module, config, chunk_manager, gemini_manager)

    @staticmethod
    def set_params_to_ignore(params_to_ignore: Iterable[torch.Tensor]) -> None:
        """Leave these parameters out of the chunks; call it before wrapping (a mark set
        afterwards has no effect), as with ColossalAI's `ZeroDDP.set_params_to_ignore`.

        An ignored parameter stays an ordinary tensor of the module on each rank (moved to the
        compute device, and cast to the compute dtype when floating point): it is never
        broadcast, reduced or sharded, so each rank keeps its own value and, after backward, its
        own local gradient in `.grad`, for the user to synchronise as they wish. The ZeRO
        optimizer does not step it: build the optimizer passed to `zero_optim_wrapper` over the
        other parameters (it refuses parameters the model does not own) and step the ignored
        ones with an optimizer of your own, zeroing their `.grad` yourself. Their gradients are
        not unscaled or clipped by the ZeRO optimizer: under fp16 loss scaling they carry the
        loss scale (`optimizer.loss_scale`). `state_dict()` holds them as they are (rank 0's
        values when `only_rank_0`), and `load_state_dict()` copies them in on every rank (see
        [Note: ignored parameters] in prepare/ignore.py).

        Args:
            params_to_ignore: the parameters to leave out.
        """
        mark_ignored(params_to_ignore)


ZeroDDP = GeminiDDP


def _shard_size(chunk_manager: ChunkManager) -> int | None:
    topology = chunk_manager.topology
    return comm.world_size(topology.shard) if topology.hybrid else None


def _secondary_shard_size(chunk_manager: ChunkManager) -> int | None:
    secondary = chunk_manager.topology.secondary
    return comm.world_size(secondary) if secondary is not None else None


def _only_seed_arguments(**given: tuple[object, object]) -> None:
    changed = sorted(name for name, (value, default) in given.items() if value != default)
    if changed:
        raise ValueError(
            f"GeminiDDP with a GeminiManager takes pin_memory, force_outputs_fp32 and "
            f"strict_ddp_mode (by keyword); the managers decide the rest. Got {changed}: "
            f"build the GeminiManager / ChunkManager with them (the wire formats: "
            f"ChunkManager(wire=...)), or call ColossalAI's "
            f"GeminiDDP(module, placement_policy=..., ...) without a manager"
        )


def _seed_config(
    gemini_manager: GeminiManager,
    *,
    pin_memory: bool,
    force_outputs_fp32: bool,
    strict_ddp_mode: bool,
    prefetch: bool,
    reduce_scatter_bucket_bytes: int,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> EngineConfig:
    """The seeds' constructor: the managers the user built, translated into the engine's
    configuration, which builds nothing more (see [Note: one configuration])."""
    if not isinstance(strict_ddp_mode, bool):
        raise TypeError(f"strict_ddp_mode must be a bool, got {strict_ddp_mode!r}")
    chunk_manager = gemini_manager.chunk_manager
    if chunk_manager.keep_gathered:
        raise ValueError(
            "GeminiDDP shards parameters: build its ChunkManager with keep_gathered=False "
            "(strict_ddp_mode=True keeps every parameter replicated)"
        )
    policy = gemini_manager.policy
    if strict_ddp_mode:
        policy = replicated(policy)
    dtypes = chunk_manager.dtypes
    return EngineConfig(
        stage=3,
        device=chunk_manager.device,
        precision=MixedPrecision(
            param_dtype=dtypes.payload, compute_dtype=dtypes.compute, reduce_dtype=dtypes.reduce
        ),
        chunking=Chunking(size_numel=chunk_manager.chunk_size_numel),
        placement=Placement(
            policy=policy,
            device_budget_bytes=gemini_manager.device_budget_bytes,
            pin_memory=pin_memory,
        ),
        reduction=Reduction(
            method=chunk_manager.wire.reduce_method.value,
            bucket_bytes=reduce_scatter_bucket_bytes,
            predivide_factor=chunk_manager.predivide_factor,
        ),
        overlap=Overlap(prefetch=prefetch),
        topology=Topology(
            process_group=chunk_manager.topology.data_parallel,
            shard_size=_shard_size(chunk_manager),
            secondary_shard_size=_secondary_shard_size(chunk_manager),
        ),
        communication=_communication(chunk_manager),
        force_outputs_fp32=force_outputs_fp32,
        param_init_fn=param_init_fn,
    )


def _communication(chunk_manager: ChunkManager) -> Communication:
    """The wire formats of a ChunkManager the user built, as the engine's setting."""
    wire = chunk_manager.wire
    blocks = {q.block_numel for q in (wire.gather, wire.reduce) if q is not None}
    if len(blocks) > 1:
        raise ValueError(
            f"the ChunkManager's gather and reduce formats quantize in blocks of different "
            f"sizes ({sorted(blocks)}); GeminiDDP takes one block size for both"
        )
    return Communication(
        gather=wire.gather.kind if wire.gather is not None else "dtype",
        reduce=wire.reduce.kind if wire.reduce is not None else "dtype",
        **({"block_numel": blocks.pop()} if blocks else {}),
    )
