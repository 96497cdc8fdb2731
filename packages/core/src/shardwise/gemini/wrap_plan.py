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

from shardwise.chunk import Chunk, Pool
from shardwise.chunk.manager import PlannedChunk

# The share of the device budget kept at wrap for the activations of a step not yet run.
WRAP_ACTIVATION_SHARE = 0.25
# Bytes of optimizer state per element before the optimizer has made any (Adam's moments).
ASSUMED_STATE_BYTES = 8


class WrapPlan:
    """Where "auto" puts each chunk's shard and optimizer side at wrap (see [Note: auto places
    from the wrap]), decided as each chunk closes (see [Note: placed as each chunk closes] in
    chunk/manager.py).

    Args:
        planned: every chunk of the wrap with the elements it will hold, in chunk order (the
            chunks may still be empty).
        budget: the device budget, in bytes.
        margin_ratio: the share of the room left after the shards that sides may take (None:
            all of it).
        activation_bytes: room kept for a step's activations (None: a share of the budget).
    """

    def __init__(
        self,
        planned: list[PlannedChunk],
        budget: int,
        margin_ratio: float | None,
        *,
        activation_bytes: int | None = None,
    ) -> None:
        sharded = [p for p in planned if not p.chunk.keep_gathered]
        largest = max(
            (p.chunk.wire.gather.gathered_nbytes(p.padded_numel) for p in sharded), default=0
        )
        largest_grads = max(
            (p.padded_numel * _size(p.chunk.dtypes.reduce) for p in sharded if p.requires_grad),
            default=0,
        )
        working = 2 * largest + largest_grads
        # Chunks kept gathered hold their payload on the device whatever the plan says.
        gathered = sum(
            p.padded_numel * _size(p.chunk.dtypes.payload) for p in planned if p.chunk.keep_gathered
        )
        activations = (
            int(WRAP_ACTIVATION_SHARE * budget) if activation_bytes is None else activation_bytes
        )
        room = budget - activations - working - gathered
        self._device_shards: set[int] = set()
        for p in sharded:
            shard = p.shard_numel * _size(p.chunk.dtypes.payload)
            if shard <= room:
                self._device_shards.add(id(p.chunk))
                room -= shard
        # Sides take what the shards left, in chunk order; a side's bytes depend on which of
        # its elements are parameters, known once its chunk is packed.
        self._side_room = int((1.0 if margin_ratio is None else margin_ratio) * max(room, 0))
        # Trainable chunks close in chunk order (frozen ones close among them, as their last
        # parameters come): the sides are decided in that order.
        self._trainable = [id(p.chunk) for p in planned if p.requires_grad]
        self._next = 0

    def pools(self, chunk: Chunk) -> tuple[Pool, Pool]:
        """The pools of `chunk`'s shard and optimizer side; ask for every chunk once, closed,
        the trainable ones in chunk order."""
        if chunk.keep_gathered or id(chunk) in self._device_shards:
            payload = Pool.DEVICE
        else:
            payload = Pool.HOST
        if not chunk.requires_grad:
            return payload, Pool.DEVICE
        if self._next >= len(self._trainable) or self._trainable[self._next] != id(chunk):
            raise RuntimeError(
                f"chunk {chunk.chunk_id} asked out of order: the wrap plan decides the sides "
                f"of trainable chunks in chunk order, once each"
            )
        self._next += 1
        # A side beside a host shard saves no copy: it stays in host memory.
        side = wrap_side_bytes(chunk)
        if payload is Pool.DEVICE and side <= self._side_room:
            self._side_room -= side
            return payload, Pool.DEVICE
        return payload, Pool.HOST


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


__all__ = [
    "ASSUMED_STATE_BYTES",
    "WRAP_ACTIVATION_SHARE",
    "WrapPlan",
    "wrap_side_bytes",
]
