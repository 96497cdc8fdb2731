"""Parameters that hold only this rank's slice of their values (built in a `ZeroInitContext`,
see [Note: sharded construction] in zero/init_context.py): how the engine recognises them, sizes
them and makes them whole again just before packing them into a chunk."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwise import comm
from shardwise.comm import CommStats

SLICE_ATTRIBUTE = "_shardwise_slice"


class ParamSlice:
    """This rank's slice of a parameter built in a ZeroInitContext."""

    __slots__ = ("numel", "shape", "values")

    def __init__(self, values: torch.Tensor, shape: torch.Size, numel: int) -> None:
        self.values = values
        self.shape = shape
        self.numel = numel


def unslice(param: nn.Parameter, stats: CommStats, group: ProcessGroup | None) -> None:
    """Give a sliced parameter its whole values again and forget the slice."""
    param.data = gather_whole(param, stats, group)
    delattr(param, SLICE_ATTRIBUTE)


def sliced(param: torch.Tensor) -> bool:
    """Whether `param` holds only this rank's slice (built in a ZeroInitContext)."""
    return getattr(param, SLICE_ATTRIBUTE, None) is not None


def whole_numel(param: torch.Tensor) -> int:
    """Elements of `param` as built, also when it holds only this rank's slice."""
    piece: ParamSlice | None = getattr(param, SLICE_ATTRIBUTE, None)
    return piece.numel if piece is not None else param.numel()


def gather_whole(param: nn.Parameter, stats: CommStats, group: ProcessGroup | None) -> torch.Tensor:
    """The whole values of a sliced parameter, gathered from every rank's slice."""
    piece: ParamSlice = getattr(param, SLICE_ATTRIBUTE)
    values = piece.values
    full = values.new_empty(values.numel() * comm.world_size(group))
    comm.all_gather(full, piece.values, stats, group)
    return full[: piece.numel].view(piece.shape)
