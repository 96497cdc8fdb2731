"""1-D sharded tensors in the form torch.distributed.checkpoint reshards.

[Note: why ShardedTensor]
A parameter's elements are split over ranks at chunk boundaries, not evenly: DTensor's Shard(0)
only describes torch.chunk-style even splits, while ShardedTensor takes arbitrary ranges. Every
rank knows every rank's ranges (the chunk layout is deterministic), so the global metadata is
built locally, without a collective per tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharded_tensor.shard import Shard

# torch marks ShardedTensor as deprecated in favour of DTensor, which cannot express our
# uneven ranges (see [Note: why ShardedTensor]); the warning says nothing to our users.
warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)


def sharded_1d(
    local: torch.Tensor,
    numel: int,
    rank_ranges: Sequence[tuple[int, int]],
    rank: int,
    group: ProcessGroup | None = None,
) -> ShardedTensor:
    """A ShardedTensor of global size [numel] whose rank r of `group` holds `rank_ranges[r]`;
    `local` is this rank's part (numel = its range's length) and is used in place, not copied."""
    device = local.device
    # Placements name global ranks: under hybrid sharding `group` is one shard group.
    ranks = _global_ranks(group, len(rank_ranges))
    metas = [
        ShardMetadata([begin], [end - begin], f"rank:{ranks[r]}/{device}")
        for r, (begin, end) in enumerate(rank_ranges)
        if end > begin
    ]
    metadata = ShardedTensorMetadata(
        metas, torch.Size([numel]), TensorProperties(dtype=local.dtype)
    )
    begin, end = rank_ranges[rank]
    local_shards = []
    if end > begin:
        if local.numel() != end - begin:
            raise AssertionError(f"local part has {local.numel()} elements, range is {end - begin}")
        local_shards.append(
            Shard(local, ShardMetadata([begin], [end - begin], f"rank:{ranks[rank]}/{device}"))
        )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, metadata, process_group=group
    )


def local_part(tensor: ShardedTensor) -> torch.Tensor | None:
    shards = tensor.local_shards()
    return shards[0].tensor if shards else None


def _global_ranks(group: ProcessGroup | None, size: int) -> list[int]:
    if group is None or not dist.is_initialized():
        return list(range(size))
    return dist.get_process_group_ranks(group)
