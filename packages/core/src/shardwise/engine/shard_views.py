"""The shard views a wrapped optimizer steps in place of the model's parameters.

[Note: the optimizer sees shard views]
Every trainable parameter is replaced, in the wrapped optimizer's param_groups, by the part of
it this rank owns: a 1-D view into its chunk's fp32 master shard, whose `.grad` is the matching
view into the chunk's reduced fp32 gradient shard. Parameter groups (learning rates, weight
decay) are therefore kept exactly, and any optimizer that updates elementwise (SGD, Adam,
AdamW, fused or not) runs unchanged on 1/N of the state. Parameters with no element on this rank
drop out of this rank's groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.chunk import Chunk, ChunkManager
from shardwise.prepare.ignore import is_ignored


@dataclass(frozen=True, slots=True)
class ShardViews:
    """What `bind_shard_views` made of an optimizer's parameters.

    Attributes:
        slots: per chunk id, (view, begin, end within the chunk's shard, the tensor's
            position in the step's got-gradient flags) for each view of that chunk.
        groups_of_chunk: per chunk id, per parameter group, the views of that chunk the group
            steps (see [Note: the step, chunk by chunk] in engine/optimizer.py).
        by_name: parameter name -> its view (checkpoints use it).
        group_param_names: every group's parameters by name, in the order the user gave them
            (frozen ones and ones this rank owns no element of too): torch's parameter
            numbers in checkpoints.
    """

    slots: dict[int, list[tuple[torch.Tensor, int, int, int]]]
    groups_of_chunk: dict[int, list[list[torch.Tensor]]]
    by_name: dict[str, torch.Tensor]
    group_param_names: list[list[str]]


def bind_shard_views(
    optimizer: torch.optim.Optimizer, manager: ChunkManager, chunks: list[Chunk]
) -> ShardViews:
    """Put `optimizer`'s parameters' shard views in its param groups, each bound to its chunk's
    optimizer state (see [Note: the optimizer sees shard views]); `chunks` are the model's
    trainable chunks, in the order of the step's got-gradient flags. Refuses parameters the
    model does not own, or that `set_params_to_ignore` left to the user."""
    unmanaged = [
        param
        for group in optimizer.param_groups
        for param in group["params"]
        if not manager.manages(param)
    ]
    ignored = [tuple(param.shape) for param in unmanaged if is_ignored(param)]
    if ignored:
        raise ValueError(
            f"optimizer holds {len(ignored)} parameter(s) marked by set_params_to_ignore "
            f"(shapes {', '.join(map(str, ignored[:5]))}): the engine leaves those to you, "
            f"so build this optimizer over the other parameters and step the ignored ones "
            f"with an optimizer of your own"
        )
    foreign = [str(tuple(param.shape)) for param in unmanaged]
    if foreign:
        raise ValueError(
            f"optimizer holds {len(foreign)} parameter(s) the model does not own (shapes "
            f"{', '.join(foreign[:5])}); build the optimizer over model.parameters() of "
            f"the model passed to zero_model_wrapper"
        )
    for chunk in chunks:
        # Its master readable (a master an optimizer before left on the disk tier is read in;
        # the next step writes it back), and no view or state of that optimizer kept.
        chunk.ensure_resident()
        chunk.optimizer_state.unbind()
    flag_position = {
        (chunk.chunk_id, index): position
        for position, (chunk, index) in enumerate(
            (chunk, index) for chunk in chunks for index in range(len(chunk.tensors))
        )
    }
    views = ShardViews(
        slots={chunk.chunk_id: [] for chunk in chunks},
        groups_of_chunk={},
        by_name={},
        group_param_names=[],
    )
    num_groups = len(optimizer.param_groups)
    for group_index, group in enumerate(optimizer.param_groups):
        shards: list[torch.Tensor] = []
        names: list[str] = []
        views.group_param_names.append(names)
        for param in group["params"]:
            chunk, index = manager.locate(param)
            names.append(chunk.tensors[index].name)
            if not param.requires_grad:
                continue
            owned = chunk.tensor_shard_range(index)
            if owned is None:
                continue
            begin, end = owned
            shard = chunk.master[begin:end]
            position = flag_position[(chunk.chunk_id, index)]
            views.slots[chunk.chunk_id].append((shard, begin, end, position))
            views.by_name[chunk.tensors[index].name] = shard
            chunk.optimizer_state.bind(shard, begin, end)
            views.groups_of_chunk.setdefault(chunk.chunk_id, [[] for _ in range(num_groups)])[
                group_index
            ].append(shard)
            shards.append(shard)
        group["params"] = shards
    return views


__all__ = ["ShardViews", "bind_shard_views"]
