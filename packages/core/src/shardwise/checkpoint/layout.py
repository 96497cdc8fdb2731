"""Where each parameter's elements live across ranks, in the parameter's own coordinates.

A checkpoint speaks of parameters, not chunks: every parameter is saved as a 1-D tensor of its
numel, split into the ranges the ranks own. Chunk size, padding, stage and world size are
therefore free to differ between the run that saves and the run that loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.checkpoint.saved_module import saved_module
from shardwise.chunk import Chunk
from shardwise.engine.model import ZeroModel


@dataclass(frozen=True, slots=True)
class ParamSlice:
    """One parameter as a checkpoint sees it.

    Attributes:
        name: the parameter's first name in `module.named_parameters()` (a tied weight once).
        shape: its shape.
        numel: its element count.
        rank_ranges: for every rank, the (begin, end) range of the flattened parameter it owns.
        chunk: the chunk holding it on this rank.
        index: its index in that chunk.
    """

    name: str
    shape: torch.Size
    numel: int
    rank_ranges: tuple[tuple[int, int], ...]
    chunk: Chunk
    index: int

    @property
    def trainable(self) -> bool:
        return self.chunk.requires_grad

    def local_range(self) -> tuple[int, int]:
        return self.rank_ranges[self.chunk.rank]

    def local_values(self) -> torch.Tensor:
        """This rank's elements: the fp32 master for trainable parameters, else the payload."""
        if self.trainable:
            # A master on the disk tier stays in memory until the next step writes it back.
            self.chunk.ensure_resident()
        owned = self.chunk.tensor_shard_range(self.index)
        if owned is None:
            source = self.chunk.master if self.trainable else self.chunk.payload.shard
            return source[:0]
        begin, end = owned
        return (self.chunk.master if self.trainable else self.chunk.payload.shard)[begin:end]


def param_slices(model: ZeroModel) -> list[ParamSlice]:
    """Every managed parameter of `model`, in `named_parameters()` order."""
    manager = model.chunk_manager
    slices = []
    for name, param in saved_module(model.module).named_parameters():
        chunk, index = manager.locate(param)
        info = chunk.tensors[index]
        ranges = []
        for rank in range(chunk.world_size):
            shard_begin = rank * chunk.shard_numel
            begin = max(info.offset, shard_begin)
            end = min(info.offset + info.numel, shard_begin + chunk.shard_numel)
            if begin >= end:
                begin = end = 0
            else:
                begin, end = begin - info.offset, end - info.offset
            ranges.append((begin, end))
        slices.append(ParamSlice(name, info.shape, info.numel, tuple(ranges), chunk, index))
    return slices
