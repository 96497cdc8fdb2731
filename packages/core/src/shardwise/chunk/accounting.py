"""What a chunk's buffers hold now, in bytes: the model-state figures of memory reports and the
memory manager's budget checks (see [Note: chunk buffers] and [Note: pools] in chunk.py)."""

from __future__ import annotations

import torch

from shardwise.chunk.chunk import Chunk
from shardwise.chunk.states import Pool


def storage_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes a buffer holds now (zero for one released by resizing its storage)."""
    return 0 if tensor is None else tensor.untyped_storage().size()


def resident_bytes(chunk: Chunk) -> dict[str, int]:
    """Bytes `chunk` holds now, per buffer kind."""
    nbytes = storage_bytes
    payload = (
        nbytes(chunk.payload.full)
        + nbytes(chunk.payload.full_compute)
        + nbytes(chunk.payload.secondary)
        + chunk.wire.held_bytes()
    )
    payload += 0 if chunk.keep_gathered else nbytes(chunk.payload.shard)
    master = 0 if chunk.master is chunk.payload.shard else nbytes(chunk.master)
    # Stage 1's gradient shard may be a view into its full gradient buffer: counted once.
    shard = 0 if chunk.grads.shard_in_full else nbytes(chunk.grads.shard)
    grads = nbytes(chunk.grads.full) + shard
    return {"params": payload, "master": master, "grads": grads}


def resident_bytes_by_pool(chunk: Chunk) -> dict[Pool, int]:
    """Bytes `chunk` holds now in each memory pool (optimizer state excluded: see
    `chunk.optimizer_state`; the disk tier's files excluded: see `disk_bytes`)."""
    nbytes = storage_bytes
    held = {
        Pool.DEVICE: nbytes(chunk.payload.full)
        + nbytes(chunk.payload.full_compute)
        + nbytes(chunk.grads.full)
        + nbytes(chunk.payload.secondary)
        + chunk.wire.held_bytes(),
        Pool.HOST: 0,
    }
    if not chunk.keep_gathered:
        held[chunk.placement.payload] += nbytes(chunk.payload.shard)
    # A side on the disk tier holds its gradient shard (and, within its step, its master) in
    # host memory; what its files hold is `disk_bytes`.
    if chunk.master is not chunk.payload.shard:
        held[chunk.placement.optim_memory] += nbytes(chunk.master)
    if not chunk.grads.shard_in_full:
        held[chunk.placement.optim_memory] += nbytes(chunk.grads.shard)
    return held


def disk_bytes(chunk: Chunk) -> int:
    """Bytes of `chunk`'s master and optimizer state on the disk tier (0 off it)."""
    disk = chunk.placement.disk
    return disk.stored_bytes(chunk.chunk_id) if disk is not None else 0


def device_resident_bytes(chunk: Chunk) -> int:
    """`resident_bytes_by_pool(chunk)[Pool.DEVICE]`, without building the dict: the memory
    manager asks after every gather and gradient, for every chunk."""
    return transient_bytes(chunk) + resting_device_bytes(chunk)


def resting_device_bytes(chunk: Chunk) -> int:
    """Device bytes `chunk` holds between steps: its shard and its optimizer side, where their
    pools are the device (its optimizer's state excluded)."""
    nbytes = storage_bytes
    held = 0
    if not chunk.keep_gathered and chunk.placement.payload is Pool.DEVICE:
        held += nbytes(chunk.payload.shard)
    if chunk.placement.optim is Pool.DEVICE:
        if chunk.master is not chunk.payload.shard:
            held += nbytes(chunk.master)
        if not chunk.grads.shard_in_full:
            held += nbytes(chunk.grads.shard)
    return held


def gathered_bytes(chunk: Chunk) -> int:
    """Device bytes a gather of `chunk` allocates (payload, its compute copy, and what its
    wire receives into: see [Note: wire formats] in chunk/wire/formats.py)."""
    return chunk.wire.gather.gathered_nbytes(chunk.padded_numel)


def gathered_held_bytes(chunk: Chunk) -> int:
    """Device bytes `chunk`'s gathered payload (and its compute copy, and its wire's buffers)
    hold now: all of a gather's, part of it while a prefetch runs, none while sharded."""
    return (
        storage_bytes(chunk.payload.full)
        + storage_bytes(chunk.payload.full_compute)
        + chunk.wire.held_bytes()
    )


def transient_bytes(chunk: Chunk) -> int:
    """Device bytes `chunk` holds now that a step allocates and frees: its gathered payload
    (and compute copy, and its wire's buffers), its gradient buffer, and its secondary copy
    (hpZ). Every placement
    needs them at once where the step does; the rest of the model state can wait in host
    memory."""
    return (
        gathered_held_bytes(chunk)
        + storage_bytes(chunk.grads.full)
        + storage_bytes(chunk.payload.secondary)
    )
