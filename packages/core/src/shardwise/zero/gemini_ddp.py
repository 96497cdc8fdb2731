"""Stage 3 under its seed names: GeminiDDP / ZeroDDP, and its construction from a config dict."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.chunk import ChunkManager
from shardwise.chunk.search import (
    DEFAULT_MIN_CHUNK_BYTES,
    DEFAULT_SEARCH_N_GRIDS,
    DEFAULT_SEARCH_RANGE_BYTES,
    ChunkSearchResult,
    default_chunk_search,
)
from shardwise.comm import CommStats
from shardwise.gemini import GeminiManager, placement_policy
from shardwise.zero.config import MixedPrecision, ZeroConfig, compute_device
from shardwise.zero.ignore import is_ignored, mark_ignored
from shardwise.zero.init_context import whole_numel
from shardwise.zero.model import ZeroModel, chunk_manager_for

_log = logging.getLogger(__name__)

_GEMINI_CONFIG_KEYS = (
    "device",
    "placement_policy",
    "pin_memory",
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
    "gradient_reduction",
    "reduce_scatter_bucket_bytes",
    "param_init_fn",
    "gather_units",
    "shard_size",
    "secondary_shard_size",
)


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

    Args:
        module: the model to shard.
        gemini_manager: placement policy and the (empty) chunk manager to pack into; the chunk
            manager's device, dtypes, chunk size and process group apply.
        pin_memory: pin host copies of chunks; only meaningful when chunks live in host memory
            while computing on CUDA, which the "cuda" policy never does.
        force_outputs_fp32: cast floating-point outputs to fp32.
        strict_ddp_mode: replicate every tensor instead of sharding; refused here, since that
            is plain data parallelism: use `ColoDDP` or `zero_model_wrapper(zero_stage=1)`.
        prefetch: gather the next chunk of the recorded order ahead of its use.
        reduce_scatter_bucket_bytes: reduce the gradients of consecutive chunks together until
            they reach this many bytes (0: one reduction per chunk).
        param_init_fn: initialises a module of a model built on the meta device (see
            `ZeroConfig`).
    """

    def __init__(
        self,
        module: nn.Module,
        gemini_manager: GeminiManager,
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        *,
        prefetch: bool = True,
        reduce_scatter_bucket_bytes: int = 0,
        param_init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        if not isinstance(gemini_manager, GeminiManager):
            raise TypeError(
                f"gemini_manager must be a GeminiManager, got {type(gemini_manager).__name__}"
            )
        _check_flags(pin_memory, force_outputs_fp32, strict_ddp_mode, prefetch)
        chunk_manager = gemini_manager.chunk_manager
        if chunk_manager.keep_gathered:
            raise ValueError(
                "GeminiDDP shards parameters: build its ChunkManager with keep_gathered=False"
            )
        # The seeds' entry point hands over built managers: the config is read off them.
        dtypes = chunk_manager.dtypes
        config = ZeroConfig(
            stage=3,
            device=chunk_manager.device,
            mixed_precision=MixedPrecision(
                param_dtype=dtypes.payload, compute_dtype=dtypes.compute, reduce_dtype=dtypes.reduce
            ),
            chunk_size_numel=chunk_manager.chunk_size_numel,
            process_group=chunk_manager.topology.data_parallel,
            shard_size=_shard_size(chunk_manager),
            secondary_shard_size=_secondary_shard_size(chunk_manager),
            gradient_reduction=chunk_manager.reduce_method.value,
            prefetch=prefetch,
            overlap_communication=gemini_manager.policy.allows_overlapped_reduction,
            force_outputs_fp32=force_outputs_fp32,
            reduce_scatter_bucket_bytes=reduce_scatter_bucket_bytes,
            param_init_fn=param_init_fn,
        )
        self._build(module, config, gemini_manager, pin_memory)

    @classmethod
    def from_config(
        cls, module: nn.Module, config: ZeroConfig, gemini_manager: GeminiManager, pin_memory: bool
    ) -> GeminiDDP:
        """Stage 3 from a config parsed once (`zero_model_wrapper`'s path) and the placement
        over an empty chunk manager built from it."""
        model = cls.__new__(cls)
        model._build(module, config, gemini_manager, pin_memory)
        return model

    def _build(
        self,
        module: nn.Module,
        config: ZeroConfig,
        gemini_manager: GeminiManager,
        pin_memory: bool,
    ) -> None:
        self.pin_memory = pin_memory
        gemini_manager.pin_memory = pin_memory
        ZeroModel.__init__(self, module, config, gemini_manager.chunk_manager, gemini_manager)

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
        [Note: ignored parameters] in zero/ignore.py).

        Args:
            params_to_ignore: the parameters to leave out.
        """
        mark_ignored(params_to_ignore)


ZeroDDP = GeminiDDP


def gemini_ddp_from_config(model: nn.Module, gemini_config: Mapping[str, Any]) -> GeminiDDP:
    """Build a GeminiDDP from `zero_model_wrapper`'s `gemini_config` dict.

    Keys: device (default cuda:<current> or cpu); placement_policy ("cuda"/"device", "cpu",
    "static"); device_budget_bytes, shard_param_frac, offload_optim_frac, offload_param_frac
    (see GeminiManager); pin_memory; force_outputs_fp32; strict_ddp_mode; chunk_size_numel
    (elements per chunk; None or absent: searched with chunk_search_range and min_chunk_size,
    in bytes, and chunk_search_n_grids); hidden_dim (chunk sizes rounded up to a multiple);
    mixed_precision (a `MixedPrecision`, or a torch dtype for parameters); process_group;
    prefetch; gradient_reduction ("auto", "reduce_scatter", "all_to_all" or "all_reduce", see
    ZeroConfig); param_init_fn (initialises each module of a model built on the meta device;
    see ZeroConfig); gather_units (module classes or qualified names gathered as one block
    besides the blocks holding experts; see ZeroConfig); shard_size (hybrid sharding over
    groups of that many ranks; see ZeroConfig); secondary_shard_size (ZeRO++ hpZ: backward
    gathers inside groups of that many ranks; see ZeroConfig).
    """
    config = dict(gemini_config)
    unknown = sorted(set(config) - set(_GEMINI_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"gemini_config keys {unknown} are unknown; known keys: {list(_GEMINI_CONFIG_KEYS)}"
        )
    device = compute_device(config.get("device"))
    mixed_precision = config.get("mixed_precision", MixedPrecision())
    if isinstance(mixed_precision, torch.dtype):
        mixed_precision = MixedPrecision(param_dtype=mixed_precision)
    if not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision must be a MixedPrecision or torch.dtype, got {mixed_precision!r}"
        )
    hidden_dim = config.get("hidden_dim")
    if hidden_dim is not None and (
        isinstance(hidden_dim, bool) or not isinstance(hidden_dim, int) or hidden_dim < 1
    ):
        raise ValueError(f"hidden_dim must be a positive int, got {hidden_dim!r}")
    pin_memory = config.get("pin_memory", False)
    prefetch = config.get("prefetch", True)
    force_outputs_fp32 = config.get("force_outputs_fp32", False)
    _check_flags(pin_memory, force_outputs_fp32, config.get("strict_ddp_mode", False), prefetch)
    policy = placement_policy(
        config.get("placement_policy", "cuda"),
        shard_param_frac=config.get("shard_param_frac", 1.0),
        offload_optim_frac=config.get("offload_optim_frac", 0.0),
        offload_param_frac=config.get("offload_param_frac", 0.0),
        gpu_margin_mem_ratio=config.get("gpu_margin_mem_ratio"),
    )
    chunk_size = config.get("chunk_size_numel")
    reason = f"chunk_size_numel {chunk_size} as set in gemini_config"
    if chunk_size is None:
        searched = _searched_chunk_size(model, config, mixed_precision, hidden_dim)
        chunk_size, reason = searched.chunk_size_numel, searched.reason
    elif hidden_dim is not None:
        chunk_size = -(-chunk_size // hidden_dim) * hidden_dim
        reason += f", rounded up to a multiple of hidden_dim {hidden_dim}: {chunk_size}"
    zero_config = ZeroConfig(
        stage=3,
        device=device,
        mixed_precision=mixed_precision,
        chunk_size_numel=chunk_size,
        process_group=config.get("process_group"),
        gradient_reduction=config.get("gradient_reduction", "auto"),
        prefetch=prefetch,
        overlap_communication=policy.allows_overlapped_reduction,
        force_outputs_fp32=force_outputs_fp32,
        reduce_scatter_bucket_bytes=config.get("reduce_scatter_bucket_bytes", 0),
        param_init_fn=config.get("param_init_fn"),
        gather_units=_gather_units(config.get("gather_units", ())),
        shard_size=config.get("shard_size"),
        secondary_shard_size=config.get("secondary_shard_size"),
    )
    chunk_manager = chunk_manager_for(zero_config, CommStats())
    chunk_manager.chunk_size_reason = reason
    manager = GeminiManager(
        policy, chunk_manager, device_budget_bytes=config.get("device_budget_bytes")
    )
    return GeminiDDP.from_config(model, zero_config, manager, pin_memory)


def _shard_size(chunk_manager: ChunkManager) -> int | None:
    topology = chunk_manager.topology
    return comm.world_size(topology.shard) if topology.hybrid else None


def _secondary_shard_size(chunk_manager: ChunkManager) -> int | None:
    secondary = chunk_manager.topology.secondary
    return comm.world_size(secondary) if secondary is not None else None


def _gather_units(value: object) -> tuple[Any, ...]:
    if isinstance(value, (str, type)) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"gather_units must be a list of module classes or qualified module names, "
            f"got {value!r}"
        )
    return tuple(value)


def _check_flags(
    pin_memory: object, force_outputs_fp32: object, strict_ddp_mode: object, prefetch: object
) -> None:
    for name, value in (
        ("pin_memory", pin_memory),
        ("force_outputs_fp32", force_outputs_fp32),
        ("strict_ddp_mode", strict_ddp_mode),
        ("prefetch", prefetch),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if strict_ddp_mode:
        raise ValueError(
            "strict_ddp_mode=True replicates every tensor, which is plain data parallelism: "
            "use ColoDDP(module) or zero_model_wrapper(model, zero_stage=1) instead"
        )


def _searched_chunk_size(
    model: nn.Module,
    config: Mapping[str, Any],
    mixed_precision: MixedPrecision,
    hidden_dim: int | None,
) -> ChunkSearchResult:
    """Search a chunk size with the seeds' knobs from `config` (see `default_chunk_search`);
    the choice and its reason are logged."""
    element_size = torch.empty((), dtype=mixed_precision.param_dtype).element_size()
    # A gather allocates the payload and, when the compute dtype differs, its compute copy.
    gathered_element_size = element_size
    if mixed_precision.compute_dtype != mixed_precision.param_dtype:
        gathered_element_size += torch.empty((), dtype=mixed_precision.compute_dtype).element_size()
    search_range = config.get("chunk_search_range", DEFAULT_SEARCH_RANGE_BYTES)
    min_chunk = config.get("min_chunk_size", DEFAULT_MIN_CHUNK_BYTES)
    for name, value in (("chunk_search_range", search_range), ("min_chunk_size", min_chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a number of bytes (int >= 0), got {value!r}")
    unique = [p for p in dict.fromkeys(model.parameters()) if not is_ignored(p)]
    groups = [
        [whole_numel(p) for p in unique if p.requires_grad],
        [whole_numel(p) for p in unique if not p.requires_grad],
    ]
    budget = config.get("device_budget_bytes")
    if isinstance(budget, bool) or not isinstance(budget, int):
        budget = None  # absent, or wrong: GeminiManager refuses it with the reason
    # Chunks are sharded over a shard group under hybrid sharding.
    shard_size = config.get("shard_size")
    result = default_chunk_search(
        groups,
        world_size=shard_size or comm.world_size(config.get("process_group")),
        param_element_size=element_size,
        gathered_element_size=gathered_element_size,
        device_budget_bytes=budget,
        search_range_bytes=search_range,
        min_chunk_bytes=min_chunk,
        n_grids=config.get("chunk_search_n_grids", DEFAULT_SEARCH_N_GRIDS),
        hidden_dim=hidden_dim,
    )
    _log.info("stage 3 chunk size searched: %s", result.reason)
    return result
