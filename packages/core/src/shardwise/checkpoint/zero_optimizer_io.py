"""A ZeRO optimizer's state in torch's whole-shape layout (see optimizer_checkpoint.py).

Each rank steps only its shard of every parameter, so whole moments exist nowhere: for every
chunk, each per-element state (Adam's `exp_avg`, `exp_avg_sq`) is laid out over the rank's
shard and all-gathered, one chunk at a time, as the chunk's values are for a forward pass; a
state dict kept on rank 0 alone, in host memory, is instead sent to rank 0 in parts, straight
into its whole tensors (see [Note: gathering to one rank] in chunk/whole_tensors.py).
Which parameters have state at all, and their per-parameter values (`step`), are agreed once
with one all-reduce. Loading takes back from each whole tensor the elements the rank owns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch.distributed import ReduceOp

from shardwise import comm
from shardwise.checkpoint.commit import CheckpointError, Ranks
from shardwise.checkpoint.optimizer_checkpoint import (
    OptimizerCheckpoint,
    write_optimizer_checkpoint,
)
from shardwise.checkpoint.zero_model_io import ranks_of
from shardwise.chunk import Chunk
from shardwise.chunk.whole_tensors import WholeTensorsGather, finish_one_behind
from shardwise.comm.topology import replica_index
from shardwise.engine.optimizer import ZeroOptimizer
from shardwise.optim.hybrid_adam import HybridAdam, torch_adam_group


class StateSink(Protocol):
    """Where whole per-parameter states go (a checkpoint's file writer, or a dict)."""

    def wants(self, key: str) -> bool: ...

    def add(self, key: str, value: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class _Layout:
    """What every rank agreed on: the parameter numbers, the per-element state keys with their
    dtypes, the per-parameter (scalar) keys, and which parameters have state with its scalars."""

    number_of: dict[str, int]
    elementwise: dict[str, torch.dtype]
    scalars: dict[str, torch.dtype]
    scalar_values: dict[str, list[float]]

    def state_bytes(self, numel: int) -> int:
        per_element = sum(dtype.itemsize for dtype in self.elementwise.values())
        return numel * per_element + sum(dtype.itemsize for dtype in self.scalars.values())


def _local_state(optimizer: ZeroOptimizer, name: str) -> dict[str, Any]:
    view = optimizer.shard_views.get(name)
    return optimizer.optim.state.get(view, {}) if view is not None else {}


def _layout(optimizer: ZeroOptimizer, ranks: Ranks) -> _Layout:
    elementwise: dict[str, str] = {}
    scalars: dict[str, str] = {}
    for name, view in optimizer.shard_views.items():
        for key, value in _local_state(optimizer, name).items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and key != "step":
                if value.shape != view.shape:
                    raise CheckpointError(
                        f"optimizer state {key!r} of {name} has {value.numel()} elements for "
                        f"{view.numel()} parameter elements: only per-element and scalar state "
                        f"can be saved whole"
                    )
                elementwise[key] = str(value.dtype).removeprefix("torch.")
            elif isinstance(value, (int, float)) or (
                isinstance(value, torch.Tensor) and value.dim() == 0
            ):
                dtype = value.dtype if isinstance(value, torch.Tensor) else torch.float32
                scalars[key] = str(dtype).removeprefix("torch.")
            else:
                raise CheckpointError(
                    f"optimizer state {key!r} of {name} is a {type(value).__name__} of shape "
                    f"{getattr(value, 'shape', '?')}: only per-element and scalar state can be "
                    f"saved whole"
                )
    agreed_elementwise: dict[str, str] = {}
    agreed_scalars: dict[str, str] = {}
    for their_elementwise, their_scalars in ranks.all_gather((elementwise, scalars)):
        agreed_elementwise.update(their_elementwise)
        agreed_scalars.update(their_scalars)
    scalar_keys = list(agreed_scalars)
    chunks = list(optimizer.model.chunk_manager.trainable_chunks())
    names = [info.name for chunk in chunks for info in chunk.tensors]
    # Per parameter: [has state, scalar values...]; -inf where this rank knows nothing.
    table = torch.full((len(names), 1 + len(scalar_keys)), float("-inf"), dtype=torch.float64)
    for row, name in enumerate(names):
        state = _local_state(optimizer, name)
        if state:
            table[row, 0] = 1.0
            for column, key in enumerate(scalar_keys, start=1):
                table[row, column] = float(state[key])
    manager = optimizer.model.chunk_manager
    if chunks:
        device = chunks[0].device
        agreed_table = table.to(device)
        comm.all_reduce(agreed_table, manager.stats, manager.group, op=ReduceOp.MAX)
        table = agreed_table.cpu()
    numbers = list(chain.from_iterable(optimizer.group_param_names))
    return _Layout(
        number_of={name: number for number, name in enumerate(numbers)},
        elementwise={k: getattr(torch, v) for k, v in agreed_elementwise.items()},
        scalars={k: getattr(torch, v) for k, v in agreed_scalars.items()},
        scalar_values={
            name: table[row, 1:].tolist() for row, name in enumerate(names) if table[row, 0] > 0
        },
    )


def _whole_states(optimizer: ZeroOptimizer, layout: _Layout, sink: StateSink) -> None:
    """Hand `sink` every parameter's whole state (keyed by its number as a str) that it wants.
    A collective: every rank walks every trainable chunk. One state key of one chunk is
    gathered at a time, the next one's gather running while this one's pieces are copied out:
    a rank holds at most two gathered chunk states beside the pieces."""
    manager = optimizer.model.chunk_manager

    def started() -> Iterator[_StateGather]:
        for chunk in manager.trainable_chunks():
            states = {
                str(layout.number_of[info.name]): _scalar_state(layout, info.name)
                for info in chunk.tensors
                if _has_state(layout, info.name) and sink.wants(str(layout.number_of[info.name]))
            }
            yield from _each_key(
                layout,
                states,
                sink,
                partial(_StateGather, optimizer, chunk, states=states),
            )

    finish_one_behind(started(), lambda ready: ready.finish(layout, sink), _StateGather.abandon)


def _whole_states_to_first(optimizer: ZeroOptimizer, layout: _Layout, sink: StateSink) -> None:
    """As `_whole_states` for a sink on data-parallel rank 0 alone, where the chunks live in
    host memory: each state key of each chunk is sent to rank 0 in parts, received there
    straight into the whole tensors the sink gets (see [Note: gathering to one rank] in
    chunk/whole_tensors.py), one key's messages in flight while the next is posted. The other
    ranks only send the state they hold. A collective over the first shard group."""
    manager = optimizer.model.chunk_manager
    if replica_index(manager.topology) != 0:
        return  # another shard group holds the same shards

    def started() -> Iterator[_StateToFirst]:
        for chunk in manager.trainable_chunks():
            saved = [
                index for index, info in enumerate(chunk.tensors) if _has_state(layout, info.name)
            ]
            states: dict[str, dict[str, Any]] = {}
            if chunk.rank == 0:
                for index in saved:
                    name = chunk.tensors[index].name
                    states[str(layout.number_of[name])] = _scalar_state(layout, name)
            yield from _each_key(
                layout,
                states,
                sink,
                partial(_StateToFirst, optimizer, chunk, saved, states=states),
            )

    finish_one_behind(
        started(),
        lambda ready: ready.finish(layout, sink),
        lambda abandoned: abandoned.gather.wait(),  # the messages still read the state
    )


_KeyGather = TypeVar("_KeyGather", "_StateGather", "_StateToFirst")


def _each_key(
    layout: _Layout,
    states: dict[str, dict[str, Any]],
    sink: StateSink,
    start: Callable[[str, torch.dtype], _KeyGather],
) -> Iterator[_KeyGather]:
    """One chunk's gathers, one per elementwise state key, the last of them handing the
    chunk's `states` to `sink` when finished (at once where there are no such keys)."""
    keys = list(layout.elementwise.items())
    for position, (key, dtype) in enumerate(keys):
        gather = start(key, dtype)
        gather.hand_over = position == len(keys) - 1
        yield gather
    if not keys:
        _hand_over(states, sink)


def _has_state(layout: _Layout, name: str) -> bool:
    """Whether parameter `name` is in the optimizer's groups and has state on some rank."""
    return name in layout.number_of and name in layout.scalar_values


def _scalar_state(layout: _Layout, name: str) -> dict[str, Any]:
    """Parameter `name`'s per-parameter state values (`step`), as agreed over the ranks."""
    return {
        key: torch.tensor(value, dtype=dtype)
        for (key, dtype), value in zip(
            layout.scalars.items(), layout.scalar_values[name], strict=True
        )
    }


class _StateToFirst:
    """State `key` of the tensors `saved` of a chunk, being sent to rank 0 in parts; `finish`
    waits and, there, puts each whole tensor into `states`."""

    def __init__(
        self,
        optimizer: ZeroOptimizer,
        chunk: Chunk,
        saved: list[int],
        key: str,
        dtype: torch.dtype,
        states: dict[str, dict[str, Any]],
    ) -> None:
        self.chunk, self.key, self.states = chunk, key, states
        self.hand_over = False  # whether `finish` hands the chunk's states to the sink

        def part_of(index: int) -> torch.Tensor | None:
            value = _local_state(optimizer, chunk.tensors[index].name).get(key)
            return value if isinstance(value, torch.Tensor) else None

        self.gather = WholeTensorsGather(chunk, saved, part_of, dtype)

    def finish(self, layout: _Layout, sink: StateSink) -> None:
        for index, whole in self.gather.wait().items():
            info = self.chunk.tensors[index]
            self.states[str(layout.number_of[info.name])][self.key] = whole.view(info.shape)
        if self.hand_over:
            _hand_over(self.states, sink)


def _hand_over(states: dict[str, dict[str, Any]], sink: StateSink) -> None:
    for key_of_param, state in states.items():
        sink.add(key_of_param, state)


class _StateGather:
    """State `key` over the whole chunk, being gathered: each rank lays its parameters' values
    over its shard (zeros where it holds none), and the shards are all-gathered in the
    background; `finish` waits and copies each wanted parameter's piece into `states`."""

    def __init__(
        self,
        optimizer: ZeroOptimizer,
        chunk: Chunk,
        key: str,
        dtype: torch.dtype,
        states: dict[str, dict[str, Any]],
    ) -> None:
        self.chunk, self.key, self.states = chunk, key, states
        # Whether `finish` hands the chunk's states to the sink: its last key.
        self.hand_over = False
        local = torch.zeros(chunk.shard_numel, dtype=dtype, device=chunk.device)
        for index, info in enumerate(chunk.tensors):
            owned = chunk.tensor_shard_range(index)
            value = _local_state(optimizer, info.name).get(key)
            if owned is not None and value is not None:
                local[owned[0] : owned[1]] = value
        self.full = torch.empty(chunk.padded_numel, dtype=dtype, device=chunk.device)
        manager = optimizer.model.chunk_manager
        self._local = local  # alive until the gather has read it
        self._work = comm.all_gather(self.full, local, manager.stats, manager.group, async_op=True)

    def abandon(self) -> None:
        """Wait for the gather nobody will finish (it still reads this rank's shard)."""
        if self._work is not None:
            self._work.wait()

    def finish(self, layout: _Layout, sink: StateSink) -> None:
        self.abandon()
        for info in self.chunk.tensors:
            number = layout.number_of.get(info.name)
            if number is not None and str(number) in self.states:
                piece = self.full[info.offset : info.offset + info.numel].view(info.shape)
                self.states[str(number)][self.key] = piece.to("cpu", copy=True)
        del self.full, self._local
        if self.hand_over:
            _hand_over(self.states, sink)


def _param_groups(optimizer: ZeroOptimizer) -> list[dict[str, Any]]:
    groups = []
    first = 0
    hybrid = isinstance(optimizer.optim, HybridAdam)
    for group, names in zip(optimizer.param_groups, optimizer.group_param_names, strict=True):
        saved = {k: v for k, v in group.items() if k != "params"}
        if hybrid:  # torch's Adam reads these keys back (see torch_adam_group)
            saved = torch_adam_group(saved)
        saved["params"] = list(range(first, first + len(names)))
        first += len(names)
        groups.append(saved)
    return groups


class _Collected:
    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.states: dict[int, dict[str, Any]] = {}

    def wants(self, key: str) -> bool:
        return self.keep

    def add(self, key: str, value: Any) -> None:
        self.states[int(key)] = value


def zero_optimizer_state_dict(optimizer: ZeroOptimizer, *, only_rank_0: bool) -> dict[str, Any]:
    """torch's optimizer state dict of the whole model, exactly `state` (whole-shape state,
    parameter numbers in the order the user's optimizer had them) and `param_groups`, as
    ColossalAI's and torch's optimizers return it (the loss scaler's state travels in the
    checkpoint's metadata, or through the boosted optimizer's `loss_scaler_state_dict`); with
    `only_rank_0` the other ranks get an empty dict. A collective."""
    ranks = ranks_of(optimizer.model)
    layout = _layout(optimizer, ranks)
    sink = _Collected(keep=not only_rank_0 or ranks.rank == 0)
    chunks = optimizer.model.chunk_manager.trainable_chunks()
    to_first = only_rank_0 and all(chunk.device.type == "cpu" for chunk in chunks)
    with optimizer.optim_sides_in_memory():
        if to_first:
            _whole_states_to_first(optimizer, layout, sink)
        else:
            _whole_states(optimizer, layout, sink)
    if not sink.keep:
        return {}
    return {"state": dict(sorted(sink.states.items())), "param_groups": _param_groups(optimizer)}


def gather_optimizer_state(optimizer: ZeroOptimizer, *, only_rank_0: bool = True) -> dict[str, Any]:
    """The whole optimizer state in torch's format, as a plain optimizer over the unsharded
    model gives it (`state` of whole shapes keyed by parameter number, in the order the wrapped
    optimizer's groups had the parameters; `param_groups`), and the loss scaler's state under
    "loss_scaler": what `load_optimizer_state` takes back. Each chunk's state is gathered in
    turn. A collective; with `only_rank_0` the other ranks get an empty dict."""
    state = zero_optimizer_state_dict(optimizer, only_rank_0=only_rank_0)
    if state:  # (torch's own state dict, which ColossalAI's shape keeps to, has no scaler)
        state["loss_scaler"] = optimizer.grad_scaler.state_dict()
    return state


def save_zero_optimizer(
    optimizer: ZeroOptimizer,
    checkpoint: str | Path,
    *,
    shard: bool,
    prefix: str | None = None,
    size_per_shard: float = 1024,
) -> None:
    """Write the whole optimizer state (see `zero_optimizer_state_dict`) as one file that rank
    0 writes, or with `shard` as a directory every rank writes part of. A collective."""
    with optimizer.optim_sides_in_memory():
        _save_zero_optimizer(optimizer, checkpoint, shard, prefix, size_per_shard)


def _save_zero_optimizer(
    optimizer: ZeroOptimizer,
    checkpoint: str | Path,
    shard: bool,
    prefix: str | None,
    size_per_shard: float,
) -> None:
    ranks = ranks_of(optimizer.model)
    layout = _layout(optimizer, ranks)
    manager = optimizer.model.chunk_manager
    sizes = sorted(
        (layout.number_of[info.name], layout.state_bytes(info.numel))
        for chunk in manager.trainable_chunks()
        for info in chunk.tensors
        if info.name in layout.scalar_values and info.name in layout.number_of
    )
    write_optimizer_checkpoint(
        checkpoint,
        ranks,
        sizes,
        lambda writer: _whole_states(optimizer, layout, writer),
        _param_groups(optimizer),
        optimizer.grad_scaler.state_dict(),
        shard=shard,
        prefix=prefix,
        size_per_shard=size_per_shard,
    )


def load_zero_optimizer(optimizer: ZeroOptimizer, source: OptimizerCheckpoint) -> None:
    """Load a whole-shape optimizer state (from any plugin, stage or world size): every rank
    takes the elements of its shards; hyper-parameters and the loss scaler are restored."""
    source.check_groups([len(names) for names in optimizer.group_param_names])
    numbers = {name: n for n, name in enumerate(chain.from_iterable(optimizer.group_param_names))}
    name_of_view = {id(view): name for name, view in optimizer.shard_views.items()}
    located = {
        info.name: (chunk, index)
        for chunk in optimizer.model.chunk_manager.trainable_chunks()
        for index, info in enumerate(chunk.tensors)
    }
    local: dict[int, dict[str, Any]] = {}
    groups = []
    position = 0
    for index, group in enumerate(optimizer.optim.param_groups):
        positions = []
        for view in group["params"]:
            name = name_of_view[id(view)]
            saved = source.state_of(numbers[name])
            if saved is not None:
                local[position] = _owned_part(located[name], saved, name)
            positions.append(position)
            position += 1
        groups.append({**source.hyperparameters(index, group), "params": positions})
    optimizer.optim.load_state_dict({"state": local, "param_groups": groups})
    optimizer.state_replaced()
    scaler = optimizer.grad_scaler
    # A scaler of another kind (a bf16 or fp32 run's constant scale, loaded by an fp16 run) has
    # nothing this one could resume from: it starts afresh, as the plugin configured it.
    if source.loss_scaler is not None and source.loss_scaler.get("kind") == (
        scaler.state_dict().get("kind")
    ):
        scaler.load_state_dict(source.loss_scaler)


def load_optimizer_state(optimizer: ZeroOptimizer, state_dict: Mapping[str, Any]) -> None:
    """Load an optimizer state held in memory in torch's whole-shape layout (as
    `torch.optim.Optimizer.state_dict()` of the unsharded model gives it, or a Lightning
    checkpoint's `optimizer_states[0]`): parameters numbered in the order the wrapped
    optimizer's groups had them, every tensor of its parameter's whole shape. Each rank takes
    the elements of its own shards; hyper-parameters are restored, and the loss scaler's state
    from a "loss_scaler" entry when there is one of the same kind. Local to each rank: every
    rank passes the same state.

    Raises `CheckpointError` (a ValueError) when `state_dict` is not an optimizer state dict,
    or its groups or tensors do not fit this model's parameters.
    """
    load_zero_optimizer(optimizer, OptimizerCheckpoint.of_state_dict(state_dict, "state_dict"))


def _owned_part(located: tuple[Chunk, int], saved: dict[str, Any], name: str) -> dict[str, Any]:
    chunk, index = located
    info = chunk.tensors[index]
    owned = chunk.tensor_shard_range(index)
    assert owned is not None  # the optimizer steps a view only where the rank owns elements
    begin = owned[0] + chunk.shard_begin - info.offset
    end = begin + owned[1] - owned[0]
    part: dict[str, Any] = {}
    for key, value in saved.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and key != "step":
            if value.numel() != info.numel:
                raise CheckpointError(
                    f"optimizer state {key!r} of {name} has {value.numel()} elements in the "
                    f"checkpoint, the parameter {info.numel}: it is of another model"
                )
            part[key] = value.reshape(-1)[begin:end].clone()
        else:
            part[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return part
