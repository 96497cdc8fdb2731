"""The one build path: an `EngineConfig` and the user's module to the engine's collaborators.

In order (each step needs the one before): the chunk size (given, or searched over the
module's parameters at stage 3), the chunk manager over the topology's groups, at stage 3
the memory manager placing its chunks, and once the parameters are packed the runtime that
runs the passes (`build_runtime`). `ZeroModel` receives them built; every front door reaches
the engine through here (see [Note: one configuration] in zero/front_door.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from shardwise import comm
from shardwise.chunk import ChunkDtypes, ChunkManager
from shardwise.chunk.search import default_chunk_search
from shardwise.comm import CommStats, ReduceScatterMethod
from shardwise.comm.topology import Topology, replicated, topology_for
from shardwise.engine.config import EngineConfig, gradient_reduction_method
from shardwise.gemini import GeminiManager
from shardwise.memory import (
    BufferPool,
    CudaHostRegister,
    HostRoom,
    Memory,
    PinnedBuffers,
    Streams,
)
from shardwise.prepare.ignore import is_ignored
from shardwise.prepare.slicing import whole_numel
from shardwise.runtime.gather_units import find_gather_units
from shardwise.runtime.hooks import HookSet
from shardwise.runtime.rank_sync import RankSync, VisitTrail
from shardwise.runtime.runtime import Runtime, RuntimeSettings

_log = logging.getLogger(__name__)


def settle_chunk_size(module: nn.Module, config: EngineConfig) -> tuple[EngineConfig, str]:
    """`config` with its chunk size known (rounded up to `hidden_dim`; searched at stage 3
    when not given), and why that size."""
    chunking = config.chunking
    if chunking.size_numel is None and config.stage == 3:
        size, reason = _searched(module, config)
    elif chunking.size_numel is None:
        size, reason = (
            config.chunk_size_numel,
            f"chunk_size_numel {config.chunk_size_numel} (default)",
        )
    else:
        size, reason = chunking.size_numel, f"chunk_size_numel {chunking.size_numel} as set"
        if chunking.hidden_dim is not None:
            size = -(-size // chunking.hidden_dim) * chunking.hidden_dim
            reason += f", rounded up to a multiple of hidden_dim {chunking.hidden_dim}: {size}"
    return replace(config, chunking=replace(chunking, size_numel=size)), reason


def chunk_manager_for(config: EngineConfig, stats: CommStats, reason: str = "") -> ChunkManager:
    """An empty chunk manager as `config` says (its chunk size settled): size, device,
    dtypes, groups, wire formats (with the reduction method), and whether chunks keep their
    payload gathered (stages 0-2)."""
    if config.stage == 0:  # every rank a replica of the whole model (see `replicated`)
        topology = replicated(config.topology.process_group)
    else:
        topology = topology_for(
            config.topology.process_group,
            config.topology.shard_size,
            secondary_shard_size=config.topology.secondary_shard_size,
        )
    dtypes = config.precision.chunk_dtypes()
    if config.reduction.method == "auto" and averages_in_backward(config.stage, dtypes, topology):
        # Every rank keeps the whole average: the all-reduce is the collective for that.
        method = ReduceScatterMethod.ALL_REDUCE
    else:
        method = gradient_reduction_method(config.reduction.method, topology.shard)
    manager = ChunkManager(
        chunk_size_numel=config.chunk_size_numel,
        device=config.device,
        dtypes=dtypes,
        stats=stats,
        keep_gathered=config.stage < 3,
        predivide_factor=config.reduction.predivide_factor,
        wire=config.communication.wire_formats(method),
        topology=topology,
        memory=memory_for(config),
    )
    if reason:
        manager.chunk_size_reason = reason
    return manager


def memory_for(config: EngineConfig) -> Memory:
    """Where the chunks' buffers come from (see [Note: one allocator, one copy path] in
    memory/memory.py): the pool of host buffers on request (see [Note: a pool of host
    buffers]), pinned host buffers where host memory feeds a CUDA device and pinning is asked
    for (see [Note: pinned buffers, pooled]); each pool's limit follows the chunks as they are
    packed; on CUDA the side streams copies and host shards' gathers run on (see [Note:
    streams and events] in memory/streams.py)."""
    device = config.device
    pins = config.placement.pin_memory and device.type == "cuda"
    # Where host memory is a pool of its own (a CUDA device), the host's room is checked
    # before it takes more (see [Note: the host's room] in memory/host_room.py).
    room = HostRoom() if device.type == "cuda" else None
    return Memory(
        device,
        pooled=BufferPool(0) if config.pools_host_buffers else None,
        pinned=PinnedBuffers(CudaHostRegister(), room=room) if pins else None,
        streams=Streams(device),
        host_room=room,
    )


def averages_in_backward(stage: int, dtypes: ChunkDtypes, topology: Topology) -> bool:
    """Whether stage 1 averages each chunk's whole gradient over the ranks during backward,
    `.grad` viewing it (`Chunk.keep_averaged_grads`; see [Note: stage 1 averages in backward]
    in chunk/grads.py): where the parameters compute and reduce in fp32, so that `.grad` can
    view the buffer, and without hybrid sharding, whose gradients cross the shard groups as
    shards only. Elsewhere stage 1 reduces once, at the step."""
    return (
        stage == 1
        and dtypes.compute == torch.float32
        and dtypes.reduce == torch.float32
        and not topology.hybrid
    )


def gemini_manager_for(config: EngineConfig, chunk_manager: ChunkManager) -> GeminiManager:
    """Stage 3's memory manager over `chunk_manager`, placing as `config.placement` says."""
    placement = config.placement
    return GeminiManager(
        placement.policy,
        chunk_manager,
        device_budget_bytes=placement.device_budget_bytes,
    )


def build_runtime(
    module: nn.Module,
    config: EngineConfig,
    chunk_manager: ChunkManager,
    gemini: GeminiManager | None,
    *,
    rank_sync: RankSync,
    trail: VisitTrail | None,
    hooks: HookSet,
) -> Runtime:
    """The parts that run the passes of `module`, its parameters packed into `chunk_manager`,
    as `config` says: the runtime builds them in order (runtime/runtime.py); their hooks are
    kept in `hooks`."""
    # Stage 1 too, where it keeps the average for `.grad` (see [Note: stage 1 averages in
    # backward] in chunk/grads.py); otherwise its only reduction is the step's.
    stage_1_averages = averages_in_backward(
        config.stage, chunk_manager.dtypes, chunk_manager.topology
    )
    settings = RuntimeSettings(
        device=config.device,
        conditional_units=(
            find_gather_units(module, config.gather_units) if config.stage == 3 else None
        ),
        prefetch=config.overlap.prefetch,
        prefetch_chunks=config.overlap.prefetch_chunks,
        defers_param_gather=config.defers_param_gather,
        reduce_in_backward=config.stage >= 2 or stage_1_averages,
        # A placement planning every gather against its budget ("auto") waits for each.
        overlap_reductions=(
            config.overlap.communication and config.placement.policy.allows_overlapped_reduction
        ),
        # See [Note: gradients in flight] in runtime/grad_reducer.py.
        max_in_flight=1 if config.stage == 3 else 2,
        bucket_bytes=config.reduction.bucket_bytes,
    )
    return Runtime(
        module, chunk_manager, gemini, settings, rank_sync=rank_sync, trail=trail, hooks=hooks
    )


def _searched(module: nn.Module, config: EngineConfig) -> tuple[int, str]:
    """Search a chunk size with the seeds' knobs (see `default_chunk_search`); the choice and
    its reason are logged."""
    precision, chunking = config.precision, config.chunking
    element_size = torch.empty((), dtype=precision.param_dtype).element_size()
    # A gather allocates the payload and, when the compute dtype differs, its compute copy.
    gathered_element_size = element_size
    if precision.compute_dtype != precision.param_dtype:
        gathered_element_size += torch.empty((), dtype=precision.compute_dtype).element_size()
    unique = [p for p in dict.fromkeys(module.parameters()) if not is_ignored(p)]
    groups = [
        [whole_numel(p) for p in unique if p.requires_grad],
        [whole_numel(p) for p in unique if not p.requires_grad],
    ]
    # Chunks are sharded over a shard group under hybrid sharding.
    topology = config.topology
    result = default_chunk_search(
        groups,
        world_size=topology.shard_size or comm.world_size(topology.process_group),
        param_element_size=element_size,
        gathered_element_size=gathered_element_size,
        # Not the device budget: a budget an error names must keep the chunks it was measured
        # with (see [Note: the working set and the budget] in gemini/working_set.py).
        search_range_bytes=chunking.search_range_bytes,
        min_chunk_bytes=chunking.min_chunk_bytes,
        n_grids=chunking.search_n_grids,
        hidden_dim=chunking.hidden_dim,
    )
    _log.info("stage 3 chunk size searched: %s", result.reason)
    return result.chunk_size_numel, result.reason


__all__ = [
    "averages_in_backward",
    "build_runtime",
    "chunk_manager_for",
    "gemini_manager_for",
    "memory_for",
    "settle_chunk_size",
]
