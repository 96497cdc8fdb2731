"""A stage-3 module holding its whole parameters between runs, sharded again before the engine
next computes with it.

[Note: a module at rest]
Between a framework's runs (Lightning's fit, validate, test, predict) users treat the module as
their own: they `torch.save(model.state_dict())`, often on rank 0 only, read a weight, copy the
module, load other weights into it. A sharded parameter holds no element outside the forward
and backward of its gather unit (see [Note: two faces of a stage-3 parameter] in
chunk/parameters.py), so all of that would see empty tensors, silently. `give_whole_values`
therefore gathers each sharded chunk once and makes each of its parameters a plain parameter
holding its whole values (fp32, as `ZeroModel.state_dict()` gives them) in host memory, on every
rank: a full copy of the model per rank, the price of a module usable on its own. From then on
the module's values are the truth, whatever the user does to them in place: before the engine
computes again, `empty_parameters` writes them into this rank's shards (fp32 master and
payload, a local copy) and makes the parameters sharded faces again. Chunks that keep their
payload gathered are left alone: their parameters are views of it already.

`ZeroModel` holds a `ModuleAtRest`, which knows which of those states the module is in and
moves it between them; the model's `gather_module`, `shard_module`, `release_module` and its
state dicts delegate to it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ReduceOp

from shardwise import comm
from shardwise.chunk import Chunk, ChunkManager
from shardwise.chunk.parameters import empty_face, whole_face
from shardwise.engine.state_dict import gather_full_state_dict, gather_parameters

if TYPE_CHECKING:
    from shardwise.runtime.hooks import HookSet
    from shardwise.runtime.runtime import Runtime


class ModuleState(Enum):
    """Where the values of a stage-3 module's sharded parameters are."""

    SHARDED = "sharded"
    """In the chunks: each rank holds its shards, and a sharded parameter holds no element
    outside the forward and backward of its gather unit (the state while the engine runs)."""
    WHOLE = "whole"
    """In the module: every sharded parameter is a plain parameter holding its whole fp32
    values in host memory, on every rank, and those are the truth; the chunks keep their
    shards, rewritten from the module's values before the engine next computes."""
    RELEASED = "released"
    """Handed back (`ZeroModel.release_module`): every parameter is a plain parameter holding
    its whole fp32 values in host memory, the module carries no hook of the engine, and the
    engine no longer computes with it; a new engine may wrap it."""


class ModuleAtRest:
    """Which `ModuleState` a wrapped module is in, and the verbs that move it between them
    (see [Note: a module at rest]). Each verb takes the model's chunk manager, or None while
    the parameters are not packed yet (stages 1 and 2: see [Note: packed once the bucket size
    is known] in engine/packing.py), so that a verb refused, or with nothing to do, never packs
    them; only stage 3, packed when it is wrapped, is ever whole."""

    def __init__(self) -> None:
        self._state = ModuleState.SHARDED

    @property
    def state(self) -> ModuleState:
        return self._state

    def gather(self, chunk_manager: ChunkManager | None, *, stage: int) -> None:
        """SHARDED -> WHOLE (`ZeroModel.gather_module`). A collective; stage 3 only."""
        if stage != 3:
            raise ValueError(
                f"gather_module() gathers stage 3's sharded parameters; at stage {stage} "
                f"the module's parameters already hold their whole values"
            )
        if self._state is not ModuleState.SHARDED:
            raise ValueError(
                "gather_module() on a module that already holds its whole values: it would "
                "overwrite them with the shards; call shard_module() first"
            )
        assert chunk_manager is not None  # stage 3 is packed when it is wrapped
        give_whole_values(chunk_manager)
        self._state = ModuleState.WHOLE

    def shard(self, chunk_manager: ChunkManager | None) -> None:
        """WHOLE -> SHARDED (`ZeroModel.shard_module`). Local to each rank."""
        if self._state is not ModuleState.WHOLE:
            raise ValueError(
                "shard_module() on a module whose parameters are already sharded; it follows "
                "gather_module()"
            )
        assert chunk_manager is not None  # only stage 3, packed when wrapped, is whole
        empty_parameters(chunk_manager)
        self._state = ModuleState.SHARDED

    def shard_before_computing(self, chunk_manager: ChunkManager | None) -> None:
        """Shard a module left whole: its values, as the user left them, are computed with."""
        if self._state is ModuleState.WHOLE:
            self.shard(chunk_manager)

    @contextmanager
    def sharded(self, chunk_manager: ChunkManager | None, *, stage: int) -> Iterator[None]:
        """Shard a whole module for what runs inside (writing into the shards), and give it its
        whole values again after, the new ones; a sharded module stays as it is."""
        if self._state is ModuleState.SHARDED:
            yield
            return
        self.shard(chunk_manager)
        try:
            yield
        finally:
            self.gather(chunk_manager, stage=stage)

    def state_dict(
        self, module: nn.Module, chunk_manager: ChunkManager, *, only_rank_0: bool
    ) -> dict[str, Any]:
        """The whole model state (`ZeroModel.state_dict`), from the module's values where it
        holds them: those are the truth. A collective."""
        if self._state is ModuleState.WHOLE:
            write_whole_values(chunk_manager)
        return gather_full_state_dict(module, chunk_manager, only_rank_0=only_rank_0)

    def release(
        self, chunk_manager: ChunkManager | None, runtime: Runtime | None, hooks: HookSet
    ) -> None:
        """-> RELEASED (`ZeroModel.release_module`): every parameter a plain one holding its
        whole values, the chunks' host buffers freed and every hook of the engine (`hooks`,
        `runtime`'s among them) removed. A collective."""
        if self._state is ModuleState.RELEASED:
            raise ValueError("release_module() on a module already released")
        if self._state is ModuleState.WHOLE:
            self.shard(chunk_manager)  # the module's values are the truth: into the shards first
        if runtime is not None:
            runtime.wait_param_gathers()
        if chunk_manager is not None:
            release_parameters(chunk_manager)
            chunk_manager.memory.drain()
        if runtime is not None:
            runtime.close()
        hooks.remove()
        self._state = ModuleState.RELEASED


def whole_copy_bytes(chunk_manager: ChunkManager) -> int:
    """Bytes of host memory one rank's whole fp32 copy of the sharded parameters takes."""
    return sum(chunk.numel * 4 for chunk in _sharded(chunk_manager))


def agree_to_gather(chunk_manager: ChunkManager, *, ready: bool) -> tuple[bool, bool]:
    """Whether every rank is `ready` (its run finished), and whether every host can hold a
    whole fp32 copy per rank it runs (`LOCAL_WORLD_SIZE`, or every rank when unknown) in half
    its available memory: the same answers on every rank, from one all-reduce, since the
    gather that may follow is a collective. A rank whose run raised still takes part (it says
    it is not ready), so the others never wait in a gather it will not join; a module too big
    for its host stays sharded rather than have the host run out of memory."""
    group = chunk_manager.topology.data_parallel
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size(group)))
    available = _available_host_bytes()
    fits = available is None or whole_copy_bytes(chunk_manager) * local_ranks <= available // 2
    flags = torch.tensor([float(ready), float(fits)], device=chunk_manager.device)
    comm.all_reduce(flags, chunk_manager.stats, group, op=ReduceOp.MIN)
    all_ready, all_fit = (bool(flag > 0) for flag in flags.tolist())
    return all_ready, all_fit


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def give_whole_values(chunk_manager: ChunkManager) -> None:
    """Give every parameter of a sharded chunk its whole values (fp32 masters; the payload of
    frozen chunks), on CPU, as a plain parameter. A collective over the chunks' group, one
    chunk gathered at a time."""
    values = gather_parameters(chunk_manager, keep=True)
    for chunk in _sharded(chunk_manager):
        for info in chunk.tensors:
            whole_face(info.param, values[id(info.param)])


def release_parameters(chunk_manager: ChunkManager) -> None:
    """Make every managed parameter a plain parameter holding its own whole values (fp32
    masters; the payload for frozen chunks) in host memory, viewing no chunk buffer. A
    collective over the chunks' group, one chunk gathered at a time."""
    values = gather_parameters(chunk_manager, keep=True)
    for chunk in chunk_manager.chunks:
        for info in chunk.tensors:
            info.param.grad = None  # at stage 1 `.grad` may view the chunk's gradients
            whole_face(info.param, values[id(info.param)])


def write_whole_values(chunk_manager: ChunkManager) -> None:
    """Write the whole values the parameters of sharded chunks hold now into the part of each
    chunk this rank owns (fp32 master and payload). Local: each rank reads its own copy."""
    for chunk in _sharded(chunk_manager):
        for index, info in enumerate(chunk.tensors):
            value = info.param.data
            if value.shape != info.shape:
                raise ValueError(
                    f"{info.name} holds a tensor of shape {tuple(value.shape)}, but was built "
                    f"with shape {tuple(info.shape)}: change its values in place "
                    f"(param.data.copy_(...), load_state_dict) rather than giving it a new "
                    f"tensor"
                )
            owned = chunk.tensor_shard_range(index)
            if owned is None:
                continue
            begin = owned[0] + chunk.shard_begin - info.offset
            flat = value.reshape(-1)[begin : begin + owned[1] - owned[0]]
            chunk.write_range(index, begin, flat)


def empty_parameters(chunk_manager: ChunkManager) -> None:
    """Write the parameters' whole values into the shards (`write_whole_values`), then make
    each one a sharded face again, holding no element."""
    write_whole_values(chunk_manager)
    for chunk in _sharded(chunk_manager):
        for info in chunk.tensors:
            empty_face(info.param, chunk.dtypes.compute, chunk.device)


def _sharded(chunk_manager: ChunkManager) -> list[Chunk]:
    return [chunk for chunk in chunk_manager.chunks if not chunk.keep_gathered]
