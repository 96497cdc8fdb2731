"""Where "auto" places each chunk when the model is wrapped, before any step has run.

[Note: auto places from the wrap]
"auto" used to start every chunk in host memory and learn in its first step what could live
on the device. For a model larger than the device that first step was the whole of its model
state in host memory: a 10.8B Llama's masters, gradients and, at the first step, Adam's
moments, 150 GB and more, past a 125 GiB host while the device stood nearly empty. Now the
wrap places by a plan against the device budget: room is kept for the step's working set (two
gathered chunks and a gradient buffer) and for its activations, which are not known until a
forward has run: the planner's estimate where one is given (`activation_memory_bytes`, from
`shardwise.planner.estimate_activation_bytes`), else a stated share of the budget
(`WRAP_ACTIVATION_SHARE`) is kept for them;
into the rest go the shards first, in chunk order (each saves its gathers' copies for the
bytes it takes), then the optimizer sides of chunks whose shard is there (fp32 master,
gradient shard, Adam's two moments: what the first step will allocate), up to
`gpu_margin_mem_ratio` of the room left when it is given. Everything else goes to host
memory. The warm-up then measures the step (see [Note: auto placement] in auto_placement.py)
and its plan takes over: it promotes what the measured room allows and, where the activations
took more than the share kept for them, sends sides and shards back to host memory.
"""

from __future__ import annotations

import torch

from shardwise.chunk import Chunk
from shardwise.chunk.accounting import gathered_bytes

# The share of the device budget kept at wrap for the activations of a step not yet run.
WRAP_ACTIVATION_SHARE = 0.25
# Bytes of optimizer state per element before the optimizer has made any (Adam's moments).
ASSUMED_STATE_BYTES = 8


def wrap_split(
    chunks: list[Chunk],
    budget: int,
    margin_ratio: float | None,
    *,
    activation_bytes: int | None = None,
) -> tuple[set[int], set[int]]:
    """The chunks (by `id`) whose payload shard and whose optimizer side start in host memory
    (see [Note: auto places from the wrap]), room kept for `activation_bytes` (None: a share
    of the budget)."""
    host_payload = {id(c) for c in chunks if not c.keep_gathered}
    host_optim = {id(c) for c in chunks if c.requires_grad}
    sharded = [c for c in chunks if not c.keep_gathered]
    largest = max((gathered_bytes(c) for c in sharded), default=0)
    largest_grads = max(
        (c.padded_numel * _size(c.dtypes.reduce) for c in sharded if c.requires_grad), default=0
    )
    working = 2 * largest + largest_grads
    # Chunks kept gathered hold their payload on the device whatever the plan says.
    gathered = sum(c.padded_numel * _size(c.dtypes.payload) for c in chunks if c.keep_gathered)
    activations = (
        int(WRAP_ACTIVATION_SHARE * budget) if activation_bytes is None else activation_bytes
    )
    room = budget - activations - working - gathered
    for chunk in sharded:
        shard = chunk.shard_numel * _size(chunk.dtypes.payload)
        if shard <= room:
            host_payload.discard(id(chunk))
            room -= shard
    sides = int((1.0 if margin_ratio is None else margin_ratio) * max(room, 0))
    for chunk in chunks:
        if not chunk.requires_grad or id(chunk) in host_payload:
            continue
        side = wrap_side_bytes(chunk)
        if side <= sides:
            host_optim.discard(id(chunk))
            sides -= side
    return host_payload, host_optim


def wrap_side_bytes(chunk: Chunk) -> int:
    """Device bytes `chunk`'s optimizer side will take beside its shard once a step ran: the
    fp32 master (none when the shard itself is fp32), the fp32 gradient shard and Adam's two
    moments of the elements this rank owns."""
    master = 0 if chunk.dtypes.payload == torch.float32 else 4 * chunk.shard_numel
    begin, end = chunk.shard_begin, chunk.shard_begin + chunk.shard_numel
    owned = sum(
        max(0, min(end, t.offset + t.numel) - max(begin, t.offset))
        for t in chunk.tensors
        if t.param.requires_grad
    )
    return master + 4 * chunk.shard_numel + ASSUMED_STATE_BYTES * owned


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


__all__ = ["ASSUMED_STATE_BYTES", "WRAP_ACTIVATION_SHARE", "wrap_side_bytes", "wrap_split"]
