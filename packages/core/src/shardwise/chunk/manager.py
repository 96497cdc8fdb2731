"""Packing of a model's parameters into chunks, and lookups from a parameter to its chunk."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwise.chunk.chunk import Chunk, ChunkDtypes
from shardwise.comm import CommStats, ReduceScatterMethod


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
        reduce_method: how gradients are reduce-scattered (see [Note: reduce-scatter methods]
            in comm/collectives.py).
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
        reduce_method: ReduceScatterMethod = ReduceScatterMethod.NATIVE,
    ) -> None:
        if not isinstance(chunk_size_numel, int) or chunk_size_numel < 1:
            raise ValueError(f"chunk_size_numel must be a positive int, got {chunk_size_numel!r}")
        self.chunk_size_numel = chunk_size_numel
        if not isinstance(device, torch.device):
            raise TypeError(f"device must be a torch.device, got {device!r}")
        self.dtypes = dtypes or ChunkDtypes(torch.float32, torch.float32, torch.float32)
        self.device = device
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        self.keep_gathered = keep_gathered
        if not predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {predivide_factor!r}")
        self.predivide_factor = float(predivide_factor)
        self.reduce_method = reduce_method
        self.chunks: list[Chunk] = []
        self._where: dict[int, tuple[Chunk, int]] = {}  # id(param) -> (chunk, tensor index)

    def register(
        self, named_params: Iterable[tuple[str, nn.Parameter]], sharded_fraction: float = 1.0
    ) -> None:
        """Pack the parameters into chunks, then close every chunk (same order on all ranks).

        Args:
            named_params: (name, parameter) pairs in packing order.
            sharded_fraction: for a manager that shards, the share of chunks to shard: the
                first ceil(fraction x chunks) in chunk order are sharded, the rest keep their
                payload gathered (no gathers, more memory).
        """
        open_chunks: dict[bool, Chunk] = {}
        new_chunks: list[Chunk] = []
        for name, param in named_params:
            if id(param) in self._where:
                continue
            trainable = param.requires_grad
            chunk = open_chunks.get(trainable)
            if chunk is None or not chunk.can_fit(param.numel()):
                chunk = Chunk(
                    chunk_id=len(self.chunks) + len(new_chunks),
                    capacity_numel=max(self.chunk_size_numel, param.numel()),
                    dtypes=self.dtypes,
                    device=self.device,
                    group=self.group,
                    stats=self.stats,
                    keep_gathered=self.keep_gathered,
                    requires_grad=trainable,
                )
                open_chunks[trainable] = chunk
                new_chunks.append(chunk)
            chunk.predivide_factor = self.predivide_factor
            chunk.reduce_method = self.reduce_method
            self._where[id(param)] = (chunk, len(chunk.tensors))
            chunk.append(name, param)
        num_sharded = math.ceil(sharded_fraction * len(new_chunks))
        for position, chunk in enumerate(new_chunks):
            if position >= num_sharded:
                chunk.keep_gathered = True
            chunk.close()
        self.chunks.extend(new_chunks)

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
                "state": c.state.value,
                "sharded": not c.keep_gathered,
                "payload": c.payload_pool.value,
                "optim": c.optim_pool.value if c.requires_grad else None,
                "tensors": {t.name: t.state.value for t in c.tensors},
            }
            for c in self.chunks
        ]

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of parameters, master weights and gradients this rank holds now."""
        total = {"params": 0, "master": 0, "grads": 0}
        for chunk in self.chunks:
            for kind, nbytes in chunk.resident_bytes().items():
                total[kind] += nbytes
        return total

    def __repr__(self) -> str:
        return f"ChunkManager(chunks={len(self.chunks)}, chunk_size_numel={self.chunk_size_numel})"
