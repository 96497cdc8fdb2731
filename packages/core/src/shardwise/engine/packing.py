"""A wrapped module's parameters packed into chunks, once, and the runtime that hooks them.

[Note: packed once the bucket size is known]
At stages 1 and 2 a chunk is a gradient bucket, whose size the seed API gives to the
optimizer wrapper (`optim_config["reduce_bucket_size"]`), after the model is wrapped. So
those stages pack the parameters into chunks only when something first needs the chunks
(the optimizer wrapper, having set the size; a forward; a state dict), as ColossalAI's
low-level ZeRO flattens them in its optimizer: the model is packed once, never held
twice. Stage 3 packs at once: its chunk size is in the model's own configuration.

`ZeroModel` holds a `Packing`, which packs the parameters when they are first needed and packs
them again for the settings the optimizer wrapper learns (`configure_reduction`); the model's
`config`, `chunk_manager`, `gemini_manager`, `runtime` and `configure_reduction` delegate to it.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from shardwise import comm
from shardwise.chunk import ChunkManager
from shardwise.chunk.manager import ChunkPlacer
from shardwise.engine.build import (
    averages_in_backward,
    build_runtime,
    chunk_manager_for,
    gemini_manager_for,
)
from shardwise.engine.config import EngineConfig
from shardwise.gemini import GeminiManager
from shardwise.prepare.ignore import is_ignored, keep_ignored_local
from shardwise.prepare.meta_init import MetaMaterializer
from shardwise.prepare.slicing import sliced, unslice, whole_numel
from shardwise.runtime.hooks import HookSet
from shardwise.runtime.rank_sync import RankSync, VisitTrail
from shardwise.runtime.runtime import Runtime


class RegisterParameters(Protocol):
    """Puts the module's parameters into an empty chunk manager: the model's
    `_register_parameters`, which is `Packing.register_parameters` unless a subclass of the
    model packs otherwise (the legacy `ShardedModelV2`, one shard-strategy group at a time)."""

    def __call__(
        self,
        chunk_manager: ChunkManager,
        sharded_fraction: float,
        *,
        values_agree: bool,
        placer: ChunkPlacer | None,
    ) -> None: ...


class Packing:
    """Packs a wrapped module's parameters into chunks, at once at stage 3 and when first
    needed at stages 1 and 2 (see [Note: packed once the bucket size is known]), and builds
    the runtime that hooks them: the gather schedule, deferred gathers, gradient reduction.

    Args:
        module: the wrapped module, its buffers on the compute device unless it has tensors
            on the meta device.
        config: the engine's configuration; `configure_reduction` replaces it.
        chunk_manager: the empty chunk manager to pack the parameters into.
        gemini_manager: stage 3's placement of chunks over `chunk_manager`, or None (stages 1
            and 2 make their own at each packing when `config` offloads the optimizer side).
        meta: what materialises the module's meta tensors as they are packed, or None.
        rank_sync: the model's checks that ranks run the same passes, which the runtime keeps.
        trail: stage 3's record of the modules a pass ran (None at stages 1 and 2).
        hooks: the model's hooks; each runtime's hooks are a part of them.
        register: puts the parameters into the chunks (see `RegisterParameters`).
    """

    def __init__(
        self,
        module: nn.Module,
        config: EngineConfig,
        chunk_manager: ChunkManager,
        gemini_manager: GeminiManager | None,
        *,
        meta: MetaMaterializer | None,
        rank_sync: RankSync,
        trail: VisitTrail | None,
        hooks: HookSet,
        register: RegisterParameters,
    ) -> None:
        self._module = module
        self._config = config
        # The compute dtype stays the one the model was wrapped with, whatever config comes.
        self._compute_dtype = config.precision.chunk_dtypes().compute
        self._stats = chunk_manager.stats
        self._gemini_manager = gemini_manager
        self._meta = meta
        self._rank_sync = rank_sync
        self._trail = trail
        self._hooks = hooks
        self._register = register
        # The chunk manager still to pack into; None once packed.
        self._to_pack: ChunkManager | None = chunk_manager
        self._chunk_manager: ChunkManager  # set when packed
        self._runtime: Runtime | None = None  # built when packed (`_install_hooks`)

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def gemini_manager(self) -> GeminiManager | None:
        return self._gemini_manager

    @property
    def chunk_manager(self) -> ChunkManager:
        """The chunks holding the parameters (packing them first, at stages 1 and 2)."""
        self.ensure_packed()
        return self._chunk_manager

    @property
    def packed_chunk_manager(self) -> ChunkManager | None:
        """The chunks, or None while the parameters are not packed yet (without packing)."""
        return self._chunk_manager if self._to_pack is None else None

    @property
    def runtime(self) -> Runtime:
        """What runs the passes (packing the parameters first, at stages 1 and 2)."""
        self.ensure_packed()
        assert self._runtime is not None
        return self._runtime

    @property
    def built_runtime(self) -> Runtime | None:
        """The runtime, or None while the parameters are not packed yet (without packing)."""
        return self._runtime

    def ensure_packed(self) -> None:
        chunk_manager, self._to_pack = self._to_pack, None
        if chunk_manager is None:
            return
        if self._meta is None:
            self._sync_buffers()
            self._pack(chunk_manager)
        else:
            self._pack(chunk_manager)
            self._meta.finish()
            self._module.to(self._config.device)
            self._sync_buffers()
            self._meta = None  # every tensor has storage now; a later re-pack needs none

    def configure_reduction(self, config: EngineConfig) -> None:
        """Pack with `config` (stages 1 and 2), or rebuild the hooks of a model already packed,
        re-packing it when the chunk size changed (see `ZeroModel.configure_reduction`)."""
        if self._config.stage == 3:
            raise ValueError("stage 3 chunks are fixed at wrap time (gemini_config)")
        repack = config.chunk_size_numel != self._config.chunk_size_numel
        self._config = config
        if self._to_pack is not None:  # see [Note: packed once the bucket size is known]
            if repack:
                self._to_pack = chunk_manager_for(self._config, self._stats)
            self.ensure_packed()
            return
        # The model was used before its optimizer was wrapped: its chunks are rebuilt.
        self._remove_hooks()
        if repack:
            self._pack_chunks(chunk_manager_for(self._config, self._stats), values_agree=True)
        self._install_hooks()

    def _pack(self, chunk_manager: ChunkManager) -> None:
        """Move the parameters into chunks and hook the module (stage 3) and gradients."""
        self._pack_chunks(chunk_manager, values_agree=False)
        self._install_hooks()

    # [Note: offload at stages 1 and 2]
    # ColossalAI's `cpu_offload` for low-level ZeRO: the payloads stay gathered on the device
    # (they are the parameters forward and backward use), and each chunk's optimizer side
    # lives in host memory: its fp32 master, its reduced gradient shard and, through the views
    # the optimizer steps, its state. Each bucket's reduced gradient is copied to the host as
    # its reduction completes, while backward goes on (stage 2's reduce-scatters, stage 1's
    # all-reduces; stage 1 keeps `.grad` viewing the averaged buffer on the device); the
    # optimizer steps on the host, chunk by chunk, and each chunk's updated values are copied
    # back into its payload before its all-gather. The memory manager ("cpu" placement) places
    # the chunks and counts the copies (`bytes_moved()`).

    def _pack_chunks(self, chunk_manager: ChunkManager, *, values_agree: bool) -> None:
        self._chunk_manager = chunk_manager
        if self._config.offloads_optimizer:
            # See [Note: offload at stages 1 and 2]; a new manager for each packing.
            self._gemini_manager = gemini_manager_for(self._config, chunk_manager)
        gemini = self._gemini_manager
        self._register(
            chunk_manager,
            gemini.sharded_fraction if gemini is not None else 1.0,
            values_agree=values_agree,
            placer=gemini,
        )
        if self._config.stage == 1:
            # See [Note: stage 1 averages in backward] in chunk/grads.py.
            average = averages_in_backward(1, chunk_manager.dtypes, chunk_manager.topology)
            for chunk in chunk_manager.trainable_chunks():
                if average:
                    chunk.keep_averaged_grads()
                else:
                    chunk.share_grad_shard_with_full()

    def _install_hooks(self) -> None:
        """The gather schedule (stage 3), deferred parameter gathers and gradient reduction,
        as the config says: a runtime of their own, their hooks a part of the model's."""
        self._runtime = build_runtime(
            self._module,
            self._config,
            self._chunk_manager,
            self._gemini_manager,
            rank_sync=self._rank_sync,
            trail=self._trail,
            hooks=self._hooks.part(),
        )

    def _remove_hooks(self) -> None:
        if self._runtime is not None:
            self._runtime.close()

    def register_parameters(
        self,
        chunk_manager: ChunkManager,
        sharded_fraction: float,
        *,
        values_agree: bool,
        placer: ChunkPlacer | None,
    ) -> None:
        """Pack the module's parameters into chunks, in `named_parameters()` order. A parameter
        built in a ZeroInitContext is made whole only just before it is packed, and each chunk
        is sharded as soon as it is full, so the whole model never exists on one rank (see
        [Note: packing one chunk at a time] in chunk/manager.py). Parameters marked by
        `set_params_to_ignore` stay out of the chunks (see [Note: ignored parameters])."""
        stats, group = self._stats, self._config.topology.process_group

        meta = self._meta

        def make_whole(param: nn.Parameter) -> None:
            if meta is not None:
                meta.before_packing(param)
            elif sliced(param):
                unslice(param, stats, group)

        named = list(self._module.named_parameters())
        keep_ignored_local(
            [p for _, p in named], self._compute_dtype, self._config.device, make_whole
        )
        chunk_manager.register(
            [(name, p) for name, p in named if not is_ignored(p)],
            sharded_fraction=sharded_fraction,
            numel_of=whole_numel,
            make_whole=make_whole,
            values_agree=values_agree,
            placer=placer,
        )

    def _sync_buffers(self) -> None:
        """Start every rank from rank 0's buffers, in the compute dtype."""
        compute = self._compute_dtype
        for buffer in self._module.buffers():
            if buffer.is_floating_point() and buffer.dtype != compute:
                buffer.data = buffer.data.to(compute)
            comm.broadcast(buffer.data, 0, self._stats, self._config.topology.process_group)


def place_buffers(module: nn.Module, device: torch.device) -> None:
    """Move `module`'s buffers to the compute device. Its parameters are copied there as each
    chunk is packed (and freed where they were), so a model built in host memory is never
    whole on the device beside its chunks."""
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None and buffer.device != device:
                submodule._buffers[name] = buffer.to(device)
