"""Whole tensors of a chunk assembled on one rank, each in storage of its own.

[Note: gathering to one rank]
A state dict or checkpoint kept on one rank (`state_dict(only_rank_0=True)`, a full Lightning
checkpoint) needs each tensor whole there and in storage of its own: views into a gathered
chunk would make every saved tensor carry the chunk's storage, and safetensors refuses shared
storage. All-gathering each chunk and copying every tensor out of it makes every rank receive
and allocate the whole chunk, only to drop it everywhere but one rank, and makes that rank
write everything twice (the gather's buffer, then the copy). Here each rank instead sends the
keeper the part of each tensor that lies in its shard (a slice of a tensor it already holds,
so nothing is copied to send it), and the keeper receives each part straight into the tensor
it returns; its own parts it copies once. Every byte is written once, on the keeper only,
which is what a rank-0 save costs at the least, and the other ranks allocate nothing.

The parts travel as point-to-point messages matched in the order they are posted, so both
sides walk the same tensors in the same order (the chunk's layout, which every rank knows).
Used where the chunks live in host memory (gloo); on a CUDA device the all-gather stays, since
there the tensors leave the device anyway and that copy is the copy out of the gathered chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from shardwise import comm
from shardwise.chunk.chunk import Chunk

Started = TypeVar("Started")

PartOf = Callable[[int], torch.Tensor | None]
"""This rank's part of tensor `index` of the chunk (the elements its shard holds, flat), or
None where it has no values for it (zeros are sent)."""


class WholeTensorsGather:
    """Tensors `indices` of `chunk`, whole, being assembled on group rank `keeper` from every
    rank's part (see [Note: gathering to one rank]). Every rank of the chunk's group makes one
    with the same `indices`, in the same order; `wait()` gives the keeper each tensor whole
    (flat, `dtype`, on the chunk's device) and the others an empty dict.

    Args:
        chunk: the chunk whose tensors these are.
        indices: positions in `chunk.tensors`, the same on every rank.
        part_of: this rank's part of a tensor (see `PartOf`).
        dtype: the dtype of the whole tensors (parts are cast to it).
        keeper: the group rank that keeps the tensors.
    """

    def __init__(
        self,
        chunk: Chunk,
        indices: Iterable[int],
        part_of: PartOf,
        dtype: torch.dtype,
        *,
        keeper: int = 0,
    ) -> None:
        me = chunk.rank
        keeps = me == keeper
        self.whole: dict[int, torch.Tensor] = {}
        receives: list[tuple[int, torch.Tensor]] = []
        sends: list[torch.Tensor] = []
        own: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (keeper's slice, its part)
        logical_bytes = 0
        for index in indices:
            info = chunk.tensors[index]
            logical_bytes += info.numel * dtype.itemsize
            whole = torch.empty(info.numel, dtype=dtype, device=chunk.device) if keeps else None
            if whole is not None:
                self.whole[index] = whole
            for owner in range(chunk.world_size):
                begin = max(info.offset, owner * chunk.shard_numel)
                end = min(info.offset + info.numel, (owner + 1) * chunk.shard_numel)
                if begin >= end:
                    continue
                if whole is not None:
                    piece = whole[begin - info.offset : end - info.offset]
                    if owner == me:
                        own.append((piece, part_of(index)))
                    else:
                        receives.append((owner, piece))
                elif owner == me:
                    sends.append(_part_to_send(part_of(index), end - begin, dtype, chunk))
        self._messages = comm.gather_pieces(
            receives, sends, keeper, chunk.stats, chunk.group, logical_bytes=logical_bytes
        )
        # The keeper's own parts are copied while the others' arrive.
        for piece, part in own:
            if part is None:
                piece.zero_()
            else:
                piece.copy_(part.reshape(-1))

    def wait(self) -> dict[int, torch.Tensor]:
        """Each tensor whole (flat), by its index in the chunk, on the keeper; {} elsewhere."""
        self._messages.wait()
        return self.whole


def _part_to_send(
    part: torch.Tensor | None, numel: int, dtype: torch.dtype, chunk: Chunk
) -> torch.Tensor:
    if part is None:
        return torch.zeros(numel, dtype=dtype, device=chunk.device)
    if part.numel() != numel:
        raise ValueError(
            f"chunk {chunk.chunk_id}: a part of {part.numel()} elements where rank "
            f"{chunk.rank} owns {numel}"
        )
    return part.reshape(-1).to(dtype).contiguous()


def finish_one_behind(
    started: Iterable[Started],
    finish: Callable[[Started], None],
    abandon: Callable[[Started], object],
) -> None:
    """Finish each item of `started` (gathers whose messages are posted as the iterable makes
    them) once the next one has been started, so that one is in flight while the one before
    is finished; the last is finished at the end. If anything raises, the item still in flight
    is `abandon`ed (its messages waited for: they read tensors the caller may free)."""
    pending: Started | None = None
    try:
        for item in started:
            ready, pending = pending, item
            if ready is not None:
                finish(ready)
        ready, pending = pending, None
        if ready is not None:
            finish(ready)
    finally:
        if pending is not None:
            abandon(pending)
