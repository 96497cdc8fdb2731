"""Full (unsharded) state dicts of a chunked module: gathered on save, sliced on load."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp
from torch.nn.modules.module import _IncompatibleKeys

from shardwise import comm
from shardwise.chunk import Chunk, ChunkManager, Pool
from shardwise.chunk.whole_tensors import PartOf, WholeTensorsGather, finish_one_behind
from shardwise.comm.topology import replica_index


def gathered_chunks(
    chunk_manager: ChunkManager, chunks: Iterable[Chunk] | None = None
) -> Iterator[tuple[Chunk, torch.Tensor]]:
    """Every chunk (or those of `chunks`, the same on every rank) with its whole values (fp32
    masters; the payload for frozen chunks), one chunk at a time; the next chunk's gather runs
    in the background while the caller reads this one, which is dropped after. A master on the
    disk tier is read in for its gather alone. A collective over the chunks' group: every rank
    must walk it to the end."""

    def start(chunk: Chunk) -> tuple[Chunk, torch.Tensor, Any, bool]:
        fetched = chunk.requires_grad and _read_in(chunk)
        source = chunk.master if chunk.requires_grad else chunk.payload.shard
        full = torch.empty(chunk.padded_numel, dtype=source.dtype, device=chunk.device)
        work = comm.all_gather(
            full, source, chunk_manager.stats, chunk_manager.group, async_op=True
        )
        return chunk, full, work, fetched

    pending = None
    try:
        for chunk in chunk_manager.chunks if chunks is None else chunks:
            started = start(chunk)
            if pending is not None:
                ready, pending = pending, None
                yield _finished(ready)
            pending = started
        if pending is not None:
            ready, pending = pending, None
            yield _finished(ready)
    finally:
        if pending is not None:  # left early: the gather still writes into its buffer
            _finished(pending)


def _read_in(chunk: Chunk) -> bool:
    """Read `chunk`'s master in from the disk tier if it is there; whether it was."""
    if chunk.placement.optim is not Pool.DISK or chunk.optim_side_resident:
        return False
    chunk.tier.fetch().result()
    return True


def _finished(gather: tuple[Chunk, torch.Tensor, Any, bool]) -> tuple[Chunk, torch.Tensor]:
    chunk, full, work, fetched = gather
    if work is not None:
        work.wait()
    if fetched:  # gathered: its disk copy is the current one still
        chunk.tier.drop()
    return chunk, full


def gather_parameters(
    chunk_manager: ChunkManager, *, keep: bool, dtype: torch.dtype | None = torch.float32
) -> dict[int, torch.Tensor]:
    """Every managed parameter's whole values (fp32 masters; the payload for frozen chunks) on
    CPU, keyed by id(parameter), cast to `dtype` (None: as stored). One chunk is gathered at a
    time; a collective over the chunks' group, whose result only ranks with `keep` hold."""
    values: dict[int, torch.Tensor] = {}
    for chunk, full in gathered_chunks(chunk_manager):
        if keep:
            for info in chunk.tensors:
                piece = full[info.offset : info.offset + info.numel].view(info.shape)
                values[id(info.param)] = piece.to("cpu", dtype or piece.dtype, copy=True)
    return values


def gather_parameters_to_first(
    chunk_manager: ChunkManager, *, dtype: torch.dtype | None = torch.float32
) -> dict[int, torch.Tensor]:
    """Every managed parameter's whole values, as `gather_parameters` gives them, on
    data-parallel rank 0 only; the other ranks get an empty dict. Chunks in host memory send
    their parts to rank 0, which receives them straight into the tensors it returns (see
    [Note: gathering to one rank] in chunk/whole_tensors.py), one chunk's messages in flight
    while the next is posted; elsewhere every rank all-gathers each chunk and rank 0 copies its
    tensors out. A collective over the chunks' group (under hybrid sharding, over the first
    shard group alone: the others hold the same shards)."""
    topology = chunk_manager.topology
    keep = comm.rank(topology.data_parallel) == 0
    if any(chunk.device.type != "cpu" for chunk in chunk_manager.chunks):
        return gather_parameters(chunk_manager, keep=keep, dtype=dtype)
    if replica_index(topology) != 0:
        return {}
    values: dict[int, torch.Tensor] = {}

    def started() -> Iterator[tuple[Chunk, WholeTensorsGather, bool]]:
        for chunk in chunk_manager.chunks:
            fetched = chunk.requires_grad and _read_in(chunk)
            source = chunk.master if chunk.requires_grad else chunk.payload.shard
            parts = _parts_of(chunk, source)
            indices = range(len(chunk.tensors))
            yield chunk, WholeTensorsGather(chunk, indices, parts, dtype or source.dtype), fetched

    finish_one_behind(
        started(),
        lambda ready: _keep_whole(*ready, values),
        lambda abandoned: abandoned[1].wait(),  # the messages still read the chunk's shard
    )
    return values


def _parts_of(chunk: Chunk, source: torch.Tensor) -> PartOf:
    def part_of(index: int) -> torch.Tensor | None:
        owned = chunk.tensor_shard_range(index)
        return None if owned is None else source[owned[0] : owned[1]]

    return part_of


def _keep_whole(
    chunk: Chunk, gather: WholeTensorsGather, fetched: bool, values: dict[int, torch.Tensor]
) -> None:
    for index, whole in gather.wait().items():
        info = chunk.tensors[index]
        values[id(info.param)] = whole.view(info.shape)
    if fetched:  # sent: its disk copy is the current one still
        chunk.tier.drop()


def gather_full_grads(chunk_manager: ChunkManager, *, keep: bool) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's reduced (averaged) fp32 gradient, whole, on CPU, by name;
    None where no rank's gradient reached it since zero_grad(), as torch leaves `.grad`. One
    chunk is gathered at a time; a collective, whose result only ranks with `keep` hold."""
    chunks = list(chunk_manager.trainable_chunks())
    device = chunks[0].device if chunks else torch.device("cpu")
    reached = torch.tensor(
        [float(i in c.grads.received) for c in chunks for i in range(len(c.tensors))],
        device=device,
    )
    # Over every rank: under hybrid sharding another shard group's gradient counts too.
    data_parallel = chunk_manager.topology.data_parallel
    comm.all_reduce(reached, chunk_manager.stats, data_parallel, op=ReduceOp.MAX)
    flags = iter(reached.tolist())
    grads: dict[str, torch.Tensor | None] = {}
    for chunk in chunks:
        full = torch.empty(chunk.padded_numel, dtype=torch.float32, device=chunk.device)
        shard = chunk.grads.for_step().to(chunk.device)
        comm.all_gather(full, shard, chunk_manager.stats, chunk_manager.group)
        for info in chunk.tensors:
            piece = full[info.offset : info.offset + info.numel].view(info.shape)
            if next(flags) and keep:
                grads[info.name] = piece.to("cpu", copy=True)
            elif keep:
                grads[info.name] = None
    return grads


def gather_full_state_dict(
    module: nn.Module, chunk_manager: ChunkManager, *, only_rank_0: bool
) -> dict[str, Any]:
    """The module's state dict, whole, on CPU with original names and shapes (parameters in
    fp32). A collective over the chunks' group."""
    keep = not only_rank_0 or comm.rank(chunk_manager.topology.data_parallel) == 0
    if only_rank_0:
        values = gather_parameters_to_first(chunk_manager)
    else:
        values = gather_parameters(chunk_manager, keep=True)
    if not keep:
        return {}
    state: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) in values:
            state[key] = values[id(value)]
        elif isinstance(value, torch.Tensor):
            state[key] = value.detach().to("cpu", copy=True)
        else:
            state[key] = value
    return state


def load_full_state_dict(
    module: nn.Module,
    chunk_manager: ChunkManager,
    state_dict: Mapping[str, Any],
    *,
    strict: bool,
) -> _IncompatibleKeys:
    """Copy a full state dict into the chunks (each rank keeps its slice) and the buffers."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    expected = module.state_dict(keep_vars=True)
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    if strict and (missing or unexpected):
        raise ValueError(
            f"state_dict does not match the model: missing keys {missing}, unexpected keys "
            f"{unexpected}; pass strict=False to load the keys that match"
        )
    for key, target in expected.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor) or not isinstance(target, torch.Tensor):
            continue
        if chunk_manager.manages(target):
            chunk, index = chunk_manager.locate(target)
            shape = chunk.tensors[index].shape
            if value.shape != shape:
                raise ValueError(
                    f"{key}: state_dict has shape {tuple(value.shape)}, model has {tuple(shape)}"
                )
            _write_owned_part(chunk, index, value)
        else:
            if value.shape != target.shape:
                raise ValueError(
                    f"{key}: state_dict has shape {tuple(value.shape)}, "
                    f"model has {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(value)
    for chunk in chunk_manager.chunks:
        chunk.payload.refresh_gathered()
    return _IncompatibleKeys(missing, unexpected)


def _write_owned_part(chunk: Chunk, index: int, value: torch.Tensor) -> None:
    """Write the elements of tensor `index` this rank owns (the rest are other ranks')."""
    owned = chunk.tensor_shard_range(index)
    if owned is None:
        return
    info = chunk.tensors[index]
    begin = owned[0] + chunk.shard_begin - info.offset
    chunk.write_range(index, begin, value.reshape(-1)[begin : begin + owned[1] - owned[0]])
