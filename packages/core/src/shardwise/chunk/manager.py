"""Packing of a model's parameters into chunks, and lookups from a parameter to its chunk.

[Note: packing one chunk at a time]
The layout of every chunk (which parameters, in which order, what capacity) is planned first
from the parameters' element counts alone; then the parameters are packed in order and each
chunk is closed (copied into its buffer, broadcast and, at stage 3, cut to this rank's shard)
right after its last parameter goes in. A parameter that holds only a slice of its values (a
model built in a ZeroInitContext) is made whole just before it is packed, so at most the
parameters of the open chunks and one chunk buffer are whole at a time, never the model.
Planning first also keeps `sharded_fraction` exact: the number of chunks is known before the
first one closes. Every rank plans the same layout and so issues the same gathers and
broadcasts in the same order.

[Note: placed as each chunk closes]
A chunk closes on the device: its payload shard and, for a trainable chunk in 16 bits, its
fp32 master are cut there. Placing the chunks only once all were packed held every shard and
master on the device at once: a 10.8B model's 65 GB on one rank, before most of it went to
host memory. A `ChunkPlacer` (the memory manager) is handed the planned chunks before the
first one is packed, so it can plan from their sizes, and places each chunk right after it
closes: the device holds, beyond what the plan keeps there, one chunk's buffers at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwise.chunk.accounting import resident_bytes
from shardwise.chunk.chunk import Chunk
from shardwise.chunk.context import ChunkContext
from shardwise.chunk.states import ChunkDtypes
from shardwise.chunk.wire import WireFormats
from shardwise.comm import CommStats
from shardwise.comm.topology import Topology
from shardwise.memory import BufferPool, Memory


@dataclass(frozen=True, slots=True)
class PlannedChunk:
    """A chunk as planned before its parameters are packed: the (still empty) chunk and the
    elements it will hold."""

    chunk: Chunk
    numel: int

    @property
    def padded_numel(self) -> int:
        world_size = self.chunk.world_size
        return -(-self.numel // world_size) * world_size

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.chunk.world_size

    @property
    def requires_grad(self) -> bool:
        return self.chunk.requires_grad


class ChunkPlacer(Protocol):
    """Places chunks as they close (see [Note: placed as each chunk closes])."""

    def plan_placement(self, planned: list[PlannedChunk]) -> None:
        """Called once with every chunk of a packing, in chunk order, before any is packed."""

    def place_closed(self, chunk: Chunk) -> None:
        """Called right after `chunk` closes, in chunk order."""


def place_packed(chunks: list[Chunk], placer: ChunkPlacer) -> None:
    """Place chunks already packed and closed, planned together, in chunk order."""
    placer.plan_placement([PlannedChunk(c, c.numel) for c in chunks])
    for chunk in chunks:
        placer.place_closed(chunk)


class ChunkManager:
    """Packs parameters into chunks in the order given and answers where each one lives.

    Trainable and frozen parameters go to different chunks (frozen chunks need no gradient or
    master buffers). A parameter larger than `chunk_size_numel` gets a chunk of its own size.
    A parameter object seen twice (tied weights) is stored once.

    Args:
        chunk_size_numel: capacity of a chunk, in elements (not bytes).
        device: where payloads and gathered buffers live.
        dtypes: payload, compute and reduce dtypes of every chunk (default all fp32).
        group: process group the chunks are sharded over (default: the default group).
        stats: collective counters shared with the model and optimizer (default: new ones).
        keep_gathered: keep full payloads resident (stages 0-2); stage 3 shards them.
        predivide_factor: divide gradients by this before reducing them, by N / this after.
        wire: how parameters are gathered and gradients reduced (see [Note: wire formats] in
            chunk/wire/formats.py; default: the payload and reduce dtypes, reduce-scattered by
            the backend's reduce-scatter).
        topology: hybrid sharding's groups (see [Note: hybrid sharding] in
            comm/topology.py); the chunks are then sharded over its shard group and `group`
            must be left unset.
        memory: where the chunks' buffers come from and how they are copied between the
            device and host memory (see [Note: one allocator, one copy path] in
            memory/memory.py); plain buffers from torch's allocator when not given.
    """

    def __init__(
        self,
        *,
        chunk_size_numel: int,
        device: torch.device,
        dtypes: ChunkDtypes | None = None,
        group: ProcessGroup | None = None,
        stats: CommStats | None = None,
        keep_gathered: bool = False,
        predivide_factor: float = 1.0,
        wire: WireFormats | None = None,
        topology: Topology | None = None,
        memory: Memory | None = None,
    ) -> None:
        if not isinstance(chunk_size_numel, int) or chunk_size_numel < 1:
            raise ValueError(f"chunk_size_numel must be a positive int, got {chunk_size_numel!r}")
        self.chunk_size_numel = chunk_size_numel
        if not isinstance(device, torch.device):
            raise TypeError(f"device must be a torch.device, got {device!r}")
        self.dtypes = dtypes or ChunkDtypes(torch.float32, torch.float32, torch.float32)
        self.device = device
        if topology is not None and group is not None:
            raise ValueError("pass the process group or the topology, not both")
        self.topology = topology or Topology(
            data_parallel=group, shard=group, replicate=None, replicas=1
        )
        self.group = self.topology.shard
        self.stats = stats if stats is not None else CommStats()
        self.keep_gathered = keep_gathered
        if not predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {predivide_factor!r}")
        self.predivide_factor = float(predivide_factor)
        self.wire = wire if wire is not None else WireFormats()
        # What every chunk shares, handed to each as it is built.
        self.context = ChunkContext(
            dtypes=self.dtypes,
            device=self.device,
            topology=self.topology,
            stats=self.stats,
            predivide_factor=self.predivide_factor,
            wire=self.wire,
            memory=memory if memory is not None else Memory(device),
        )
        # What chose `chunk_size_numel` (the search's reason, or the setting), for summaries.
        self.chunk_size_reason = f"chunk_size_numel {chunk_size_numel} as given"
        self.chunks: list[Chunk] = []
        self._where: dict[int, tuple[Chunk, int]] = {}  # id(param) -> (chunk, tensor index)

    def register(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        sharded_fraction: float = 1.0,
        *,
        numel_of: Callable[[nn.Parameter], int] = torch.Tensor.numel,
        make_whole: Callable[[nn.Parameter], None] | None = None,
        values_agree: bool = False,
        placer: ChunkPlacer | None = None,
    ) -> None:
        """Pack the parameters into chunks, closing each chunk as soon as its last parameter is
        in (same order on all ranks; see [Note: packing one chunk at a time]).

        Args:
            named_params: (name, parameter) pairs in packing order.
            sharded_fraction: for a manager that shards, the share of chunks to shard: the
                first ceil(fraction x chunks) in chunk order are sharded, the rest keep their
                payload gathered (no gathers, more memory).
            numel_of: elements a parameter will have once whole (default: `numel()`).
            make_whole: called on each parameter just before it is packed, to give it its
                whole values (a collective when it gathers them: every rank calls it on the
                same parameters in the same order).
            values_agree: every rank already holds the same values (a re-pack), so no chunk
                broadcasts rank 0's.
            placer: places each chunk as it closes (see [Note: placed as each chunk
                closes]); None leaves every buffer on the device.
        """
        unique: dict[int, tuple[str, nn.Parameter]] = {}  # tied parameters are stored once
        for name, param in named_params:
            if id(param) not in self._where:
                unique.setdefault(id(param), (name, param))
        params = list(unique.values())
        numels = [numel_of(param) for _, param in params]
        trainable = [param.requires_grad for _, param in params]
        layouts = _plan_chunks(list(zip(numels, trainable, strict=True)), self.chunk_size_numel)
        num_sharded = math.ceil(sharded_fraction * len(layouts))
        new_chunks: list[Chunk] = []
        owner: dict[int, Chunk] = {}  # index in `params` -> its chunk
        last: dict[int, Chunk] = {}  # index of a chunk's last parameter -> the chunk
        for position, layout in enumerate(layouts):
            chunk = Chunk(
                chunk_id=len(self.chunks) + position,
                capacity_numel=layout.capacity_numel,
                context=self.context,
                keep_gathered=self.keep_gathered or position >= num_sharded,
                requires_grad=layout.trainable,
            )
            owner.update(dict.fromkeys(layout.members, chunk))
            last[layout.members[-1]] = chunk
            new_chunks.append(chunk)
        if placer is not None:
            sizes = [layout.numel for layout in layouts]
            placer.plan_placement(
                [PlannedChunk(c, n) for c, n in zip(new_chunks, sizes, strict=True)]
            )
        for index, (name, param) in enumerate(params):
            if make_whole is not None:
                make_whole(param)
            if param.numel() != numels[index]:
                raise RuntimeError(
                    f"{name} was planned with {numels[index]} elements but has "
                    f"{param.numel()} when packed"
                )
            chunk = owner[index]
            self._where[id(param)] = (chunk, len(chunk.tensors))
            chunk.append(name, param)
            if index in last:
                closed = last[index]
                closed.close(src_rank=None if values_agree else 0)
                for position, info in enumerate(closed.tensors):
                    # A sharded chunk's parameters have a compute face too (see [Note: two
                    # faces of a stage-3 parameter] in chunk/parameters.py).
                    self._where[id(info.compute)] = (closed, position)
                if placer is not None:
                    placer.place_closed(closed)
        assert all(chunk.closed for chunk in new_chunks)
        self.chunks.extend(new_chunks)
        # The pools' spare limits grow with the largest chunk.
        self.memory.keep_room_for(
            [c.padded_numel * _largest_element_size(self.dtypes) for c in new_chunks]
        )

    @property
    def memory(self) -> Memory:
        """Where the chunks' buffers come from (see [Note: one allocator, one copy path] in
        memory/memory.py)."""
        return self.context.memory

    @property
    def buffer_pool(self) -> BufferPool | None:
        """The pool of host buffers, when asked for (see [Note: a pool of host buffers])."""
        return self.context.memory.pooled

    def locate(self, param: torch.Tensor) -> tuple[Chunk, int]:
        """The chunk holding `param` and the tensor's index in it."""
        try:
            return self._where[id(param)]
        except KeyError:
            raise KeyError("parameter is not managed by this ChunkManager") from None

    def manages(self, param: torch.Tensor) -> bool:
        return id(param) in self._where

    def trainable_chunks(self) -> Iterator[Chunk]:
        return (chunk for chunk in self.chunks if chunk.requires_grad)

    def report(self) -> list[dict[str, Any]]:
        """Per chunk: id, elements, state, whether sharded, the pool of its payload and of its
        optimizer side, and each tensor's state."""
        return [
            {
                "chunk_id": c.chunk_id,
                "numel": c.numel,
                "state": c.payload.state.value,
                "sharded": not c.keep_gathered,
                "payload": c.placement.payload.value,
                "optim": c.placement.optim.value if c.requires_grad else None,
                "tensors": {t.name: t.state.value for t in c.tensors},
            }
            for c in self.chunks
        ]

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of parameters, master weights and gradients this rank holds now."""
        total = {"params": 0, "master": 0, "grads": 0}
        for chunk in self.chunks:
            for kind, nbytes in resident_bytes(chunk).items():
                total[kind] += nbytes
        return total

    def __repr__(self) -> str:
        return f"ChunkManager(chunks={len(self.chunks)}, chunk_size_numel={self.chunk_size_numel})"


def _largest_element_size(dtypes: ChunkDtypes) -> int:
    return max(
        torch.empty((), dtype=dtype).element_size()
        for dtype in (dtypes.payload, dtypes.compute, dtypes.reduce)
    )


@dataclass(slots=True)
class _Layout:
    """One planned chunk: its capacity, whether it is trainable, and its parameters' indices."""

    capacity_numel: int
    trainable: bool
    members: list[int] = field(default_factory=list)
    numel: int = 0


def _plan_chunks(params: list[tuple[int, bool]], chunk_size_numel: int) -> list[_Layout]:
    """Chunk layouts for parameters given as (numel, trainable), in order: each goes to the
    open chunk of its kind if it fits, else opens a new one of max(chunk size, numel)."""
    layouts: list[_Layout] = []
    open_layouts: dict[bool, _Layout] = {}
    for index, (numel, trainable) in enumerate(params):
        layout = open_layouts.get(trainable)
        if layout is None or layout.numel + numel > layout.capacity_numel:
            layout = _Layout(max(chunk_size_numel, numel), trainable)
            open_layouts[trainable] = layout
            layouts.append(layout)
        layout.members.append(index)
        layout.numel += numel
    return layouts
