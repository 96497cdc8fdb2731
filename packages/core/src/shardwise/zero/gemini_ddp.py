"""Stage 3 under its seed names: GeminiDDP / ZeroDDP."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from shardwise import comm
from shardwise.chunk import ChunkManager
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
from shardwise.gemini import GeminiManager
from shardwise.prepare.ignore import mark_ignored


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
            `EngineConfig`).
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
        _refuse_strict_ddp_mode(strict_ddp_mode)
        chunk_manager = gemini_manager.chunk_manager
        if chunk_manager.keep_gathered:
            raise ValueError(
                "GeminiDDP shards parameters: build its ChunkManager with keep_gathered=False"
            )
        # This front door's configuration is the managers the user built: translated into the
        # engine's, which builds nothing more (see [Note: one configuration]).
        dtypes = chunk_manager.dtypes
        config = EngineConfig(
            stage=3,
            device=chunk_manager.device,
            precision=MixedPrecision(
                param_dtype=dtypes.payload, compute_dtype=dtypes.compute, reduce_dtype=dtypes.reduce
            ),
            chunking=Chunking(size_numel=chunk_manager.chunk_size_numel),
            placement=Placement(
                policy=gemini_manager.policy,
                device_budget_bytes=gemini_manager.device_budget_bytes,
                pin_memory=pin_memory,
            ),
            reduction=Reduction(
                method=chunk_manager.reduce_method.value,
                bucket_bytes=reduce_scatter_bucket_bytes,
                predivide_factor=chunk_manager.predivide_factor,
            ),
            overlap=Overlap(prefetch=prefetch),
            topology=Topology(
                process_group=chunk_manager.topology.data_parallel,
                shard_size=_shard_size(chunk_manager),
                secondary_shard_size=_secondary_shard_size(chunk_manager),
            ),
            force_outputs_fp32=force_outputs_fp32,
            param_init_fn=param_init_fn,
        )
        self._build(module, config, chunk_manager, gemini_manager)

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


def _refuse_strict_ddp_mode(strict_ddp_mode: object) -> None:
    if not isinstance(strict_ddp_mode, bool):
        raise TypeError(f"strict_ddp_mode must be a bool, got {strict_ddp_mode!r}")
    if strict_ddp_mode:
        raise ValueError(
            "strict_ddp_mode=True replicates every tensor, which is plain data parallelism: "
            "use ColoDDP(module) or zero_model_wrapper(model, zero_stage=1) instead"
        )
