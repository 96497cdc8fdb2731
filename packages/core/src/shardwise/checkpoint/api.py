"""Sharded save and load of a whole training state, at any world size, stage or chunk size.

What a checkpoint holds (torch.distributed.checkpoint writes it, each rank its own file):
- `model.<name>`: every parameter as a 1-D sharded tensor of its numel (fp32 masters for
  trainable parameters, the stored payload for frozen ones), each rank its own elements;
- `buffer.<name>`: buffers, saved once;
- `optim.<name>.<key>`: the optimizer's per-parameter state, sharded like the parameter when it
  has one element per parameter element (Adam's moments), whole otherwise (Adam's step);
- `objects`: the optimizer's hyper-parameters, the loss scaler's full state and the caller's
  `extra`, pickled (rank 0's);
and a manifest with the model's parameter names and shapes and every file's size and checksum
(see [Note: atomic checkpoints]).
"""

from __future__ import annotations

import io
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardwise.checkpoint.commit import (
    CheckpointError,
    Ranks,
    check_save_target,
    new_version_dir,
    read_manifest,
    remove_unfinished_versions,
    verify_files,
    write_manifest_and_commit,
)
from shardwise.checkpoint.layout import ParamSlice, param_slices
from shardwise.checkpoint.progress import ProgressLoadPlanner, ProgressSavePlanner
from shardwise.checkpoint.saved_module import saved_module
from shardwise.checkpoint.sharded_tensor import local_part, sharded_1d
from shardwise.comm.topology import replica_index
from shardwise.engine.model import ZeroModel
from shardwise.engine.optimizer import ZeroOptimizer
from shardwise.logging.progress_bar import progress_wanted


def save(
    path: str | os.PathLike[str],
    model: ZeroModel,
    optimizer: ZeroOptimizer | None = None,
    extra: Any = None,
    *,
    replace_file: bool = False,
    progress: bool | None = None,
) -> None:
    """Save model, optimizer, loss scaler and `extra` to `path`, every rank writing its own
    shards in parallel; `path` then names the new checkpoint, atomically. A collective.

    Args:
        path: the checkpoint's name (a symlink to the current version's directory).
        model: the wrapped model (any stage).
        optimizer: its `ZeroOptimizer`, to save optimizer and loss-scaler state too.
        extra: anything picklable (epoch, step, RNG states, data position); rank 0's is kept.
        replace_file: an ordinary file at `path` (another kind of checkpoint of the same name)
            is replaced when the new checkpoint is published; otherwise it is refused, as an
            ordinary directory always is.
        progress: draw a progress bar of rank 0's bytes on its stderr; None (the default)
            follows SHARDWISE_PROGRESS, else shows it when stderr is a terminal (see
            [Note: when the bar shows] in logging/progress_bar.py).
    """
    bar = progress_wanted(progress)
    _check_pair(model, optimizer)
    ranks = _ranks_of(model)
    target = Path(path)
    check_save_target(target, ranks, replace_file=replace_file)
    remove_unfinished_versions(target, ranks)
    slices = param_slices(model)
    buffers = dict(saved_module(model.module).named_buffers())
    topology = model.chunk_manager.topology
    sides = optimizer.optim_sides_in_memory() if optimizer is not None else nullcontext()
    # The state is views of the live tensors (those on the disk tier read in for the block),
    # not copies: DCP copies each tensor it writes as it writes it, so a rank never holds a
    # second copy of its whole shard (see [Note: saving views] below).
    with sides:
        state: dict[str, Any] = {}
        for item in slices:
            state[f"model.{item.name}"] = _sharded(item, item.local_values().detach())
        for name, buffer in buffers.items():
            state[f"buffer.{name}"] = buffer.detach()
        objects: dict[str, Any] = {"extra": extra}
        if optimizer is not None:
            state.update(_optimizer_state(optimizer, slices))
            objects["param_groups"] = [
                {k: v for k, v in group.items() if k != "params"}
                for group in optimizer.param_groups
            ]
            objects["grad_scaler"] = optimizer.grad_scaler.state_dict()
        state["objects"] = _pickled(objects)
        version = new_version_dir(target, ranks)
        # Under hybrid sharding the first shard group writes; the others hold the same shards.
        if replica_index(topology) == 0:
            dcp_save(
                state,
                storage_writer=FileSystemWriter(version),
                planner=ProgressSavePlanner(bar=bar),
                process_group=topology.shard,
            )
    description = {
        "params": {item.name: list(item.shape) for item in slices},
        "buffers": {name: list(b.shape) for name, b in buffers.items()},
        "has_optimizer": optimizer is not None,
        "saved_world_size": slices[0].chunk.world_size if slices else 1,
        "saved_stage": model.stage,
        "optimizer_type": _type_name(optimizer.optim) if optimizer is not None else None,
        "state_dict_keys": _state_dict_keys(model, slices),
    }
    write_manifest_and_commit(target, version, description, ranks, replace_file=replace_file)


def load(
    path: str | os.PathLike[str],
    model: ZeroModel,
    optimizer: ZeroOptimizer | None = None,
    *,
    verify_checksums: bool = True,
    progress: bool | None = None,
) -> Any:
    """Load a checkpoint written by `save` into `model` (and `optimizer`), whatever world size,
    stage or chunk size wrote it, and return the saved `extra`. A collective.

    Raises `CheckpointError` (a ValueError) on every rank alike when the checkpoint is
    missing, incomplete, corrupted, or was saved from a model with other parameter names or
    shapes, naming the first problem.

    Args:
        path: the checkpoint (as given to `save`).
        model: the wrapped model (any stage, world size or chunk size).
        optimizer: its `ZeroOptimizer`, to load optimizer and loss-scaler state too.
        verify_checksums: check every file against the manifest first.
        progress: draw a progress bar of rank 0's bytes on its stderr; None (the default)
            follows SHARDWISE_PROGRESS, else shows it when stderr is a terminal (see
            [Note: when the bar shows] in logging/progress_bar.py).
    """
    bar = progress_wanted(progress)
    _check_pair(model, optimizer)
    ranks = _ranks_of(model)
    source = Path(path)
    remove_unfinished_versions(source, ranks)
    manifest = read_manifest(source)
    if verify_checksums:
        verify_files(source, manifest, ranks)
    slices = param_slices(model)
    _check_same_model(manifest, slices, model)
    if optimizer is not None:
        _check_same_optimizer(manifest, optimizer, source)
    state: dict[str, Any] = {}
    for item in slices:
        begin, end = item.local_range()
        state[f"model.{item.name}"] = _sharded(
            item, torch.empty(end - begin, dtype=item.local_values().dtype)
        )
    buffers = dict(saved_module(model.module).named_buffers())
    for name, buffer in buffers.items():
        state[f"buffer.{name}"] = torch.empty_like(buffer)
    metadata = FileSystemReader(source).read_metadata().state_dict_metadata
    if optimizer is not None:
        state.update(_optimizer_targets(optimizer, slices, metadata))
    state["objects"] = io.BytesIO()
    topology = model.chunk_manager.topology
    failure = None
    try:
        # Ranges are named by rank in the shard group (see ParamSlice): every shard group
        # reads for itself.
        dcp_load(
            state,
            storage_reader=FileSystemReader(source),
            planner=ProgressLoadPlanner(bar=bar),
            process_group=topology.shard,
        )
    except CheckpointException as error:
        # Raised on every rank of the group alike; it is a BaseException, which `except
        # Exception` misses.
        failure = f"{source} could not be read: {_first_failure(error)}"
    if topology.hybrid:  # one group's failure is every group's
        failure = next((f for f in ranks.all_gather(failure) if f), None)
    if failure is not None:
        raise CheckpointError(failure)
    for item in slices:
        values = local_part(state[f"model.{item.name}"])
        if values is not None:
            item.chunk.write_range(item.index, item.local_range()[0], values)
    for chunk in model.chunk_manager.chunks:
        chunk.payload.refresh_gathered()
    with torch.no_grad():
        for name, buffer in buffers.items():
            buffer.copy_(state[f"buffer.{name}"])
    state["objects"].seek(0)
    objects = torch.load(state["objects"], weights_only=False)
    if optimizer is not None:
        _restore_optimizer(optimizer, slices, state, objects)
    return objects["extra"]


def sharded_state_dict(model: ZeroModel) -> dict[str, Any]:
    """This rank's part of the model state, with the module's `state_dict()` keys, without a
    copy or a collective: each parameter a 1-D ShardedTensor of its numel over this rank's
    elements (views of the fp32 masters; the stored payload for frozen ones), buffers whole.
    The form torch.distributed.checkpoint saves and reshards, as FSDP's sharded state dict,
    except that parameters are flat: chunks split them at any element (see [Note: why
    ShardedTensor] in sharded_tensor.py). A tied weight is one tensor under each of its names.
    Views of live state: save them before the next step changes them."""
    slices = param_slices(model)
    sharded = {
        f"model.{item.name}": _sharded(item, item.local_values().detach()) for item in slices
    }
    buffers = dict(saved_module(model.module).named_buffers())
    state: dict[str, Any] = {}
    for key, entry in _state_dict_keys(model, slices).items():
        kind, _, name = entry.partition(".")
        state[key] = sharded[entry] if kind == "model" else buffers[name].detach()
    return state


def _ranks_of(model: ZeroModel) -> Ranks:
    return Ranks(model.comm_stats, model.config.topology.process_group)


def _check_pair(model: ZeroModel, optimizer: ZeroOptimizer | None) -> None:
    if not isinstance(model, ZeroModel):
        raise TypeError(f"model must be a shardwise-wrapped model, got {type(model).__name__}")
    if optimizer is not None:
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError(
                f"optimizer must be the ZeroOptimizer of the model, got {type(optimizer).__name__}"
            )
        if optimizer.model is not model:
            raise ValueError("optimizer wraps another model than the one given")


def _state_dict_keys(model: ZeroModel, slices: list[ParamSlice]) -> dict[str, str]:
    """The module's `state_dict()` keys, each with the saved entry holding its value: a tied
    weight under every name it has there, persistent buffers only. A consolidated checkpoint
    is rebuilt from this (see shardwise/checkpoint/consolidate.py)."""
    module = saved_module(model.module)
    entry_of = {id(item.chunk.tensors[item.index].param): f"model.{item.name}" for item in slices}
    for name, buffer in module.named_buffers():
        entry_of.setdefault(id(buffer), f"buffer.{name}")
    return {
        key: entry_of[id(value)]
        for key, value in module.state_dict(keep_vars=True).items()
        if id(value) in entry_of
    }


def _type_name(optimizer: torch.optim.Optimizer) -> str:
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def _check_same_optimizer(manifest: dict[str, Any], optimizer: ZeroOptimizer, source: Path) -> None:
    if not manifest["has_optimizer"]:
        raise CheckpointError(f"{source} holds no optimizer state; load it without an optimizer")
    saved = manifest.get("optimizer_type")
    here = _type_name(optimizer.optim)
    if saved is not None and saved != here:
        # Another optimizer's state would be taken silently (its lr, betas, weight decay) or
        # fail at the first step (missing moments).
        raise CheckpointError(
            f"{source} holds the state of a {saved} optimizer, but this one is a {here}: load "
            f"it with a {saved.rsplit('.', 1)[-1]}, or load the model alone (optimizer=None) "
            f"and start the new optimizer fresh"
        )


def _first_failure(error: CheckpointException) -> str:
    failures = getattr(error, "failures", {}) or {}
    for rank in sorted(failures):
        failure = failures[rank]
        # DCP keeps each rank's failure as (exception, its stack summary).
        cause = failure[0] if isinstance(failure, tuple) and failure else failure
        detail = f": {cause}" if str(cause) else ""
        return (
            f"{type(cause).__name__}{detail} on rank {rank}; a file is truncated or corrupted "
            f"(load with verify_checksums=True to name it)"
        )
    return str(error)


def _check_same_model(manifest: dict[str, Any], slices: list[ParamSlice], model: ZeroModel) -> None:
    saved = manifest["params"]
    for item in slices:
        if item.name not in saved:
            raise CheckpointError(
                f"checkpoint has no parameter {item.name!r}: it is of another model"
            )
        if list(item.shape) != saved[item.name]:
            raise CheckpointError(
                f"parameter {item.name!r} has shape {list(item.shape)} here but "
                f"{saved[item.name]} in the checkpoint: it is of another model"
            )
    extra = sorted(set(saved) - {item.name for item in slices})
    if extra:
        raise CheckpointError(f"checkpoint has parameters this model lacks, first {extra[0]!r}")
    for name, buffer in saved_module(model.module).named_buffers():
        if manifest["buffers"].get(name) != list(buffer.shape):
            raise CheckpointError(
                f"buffer {name!r} has shape {list(buffer.shape)} here but "
                f"{manifest['buffers'].get(name)} in the checkpoint"
            )


# [Note: saving views]
# `save` hands DCP views of the chunks' fp32 masters and of the optimizer's moments, not
# clones. DCP's file writer copies each tensor it writes, one at a time, when its storage is
# larger than the tensor (a slice of a chunk always is), so the copies come and go item by
# item. Cloning the state up front held a second copy of the rank's whole shard (masters and
# moments) for the length of the save: 489 MiB at the peak for a 117M GPT on 2 ranks, 1 MiB
# with views (benchmarks/RESULTS.md). Views are safe because the save is synchronous: nothing
# steps until it returns, and tensors on the disk tier stay read in until the write is done.


def _sharded(item: ParamSlice, local: torch.Tensor) -> Any:
    return sharded_1d(local, item.numel, item.rank_ranges, item.chunk.rank, item.chunk.group)


def _pickled(value: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def _optimizer_state(optimizer: ZeroOptimizer, slices: list[ParamSlice]) -> dict[str, Any]:
    """Per-parameter optimizer state. Every rank must name the same sharded keys, also for
    parameters it owns no element of, so the keys are agreed on with one all-gather."""
    local_keys: dict[str, dict[str, str]] = {}
    for item in slices:
        view = optimizer.shard_views.get(item.name)
        if view is None:
            continue
        for key, value in optimizer.optim.state.get(view, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == view.shape and value.dim() == 1:
                local_keys.setdefault(item.name, {})[key] = str(value.dtype)
    agreed = _union(local_keys, _ranks_of(optimizer.model))
    state: dict[str, Any] = {}
    for item in slices:
        view = optimizer.shard_views.get(item.name)
        per_param = optimizer.optim.state.get(view, {}) if view is not None else {}
        for key, dtype_name in agreed.get(item.name, {}).items():
            begin, end = item.local_range()
            value = per_param.get(key)
            if value is None:
                value = torch.empty(end - begin, dtype=getattr(torch, dtype_name.split(".")[1]))
            state[f"optim.{item.name}.{key}"] = _sharded(item, value.detach())
        for key, value in per_param.items():
            if key not in agreed.get(item.name, {}):
                # Whole values (Adam's step): the same on every rank that holds the parameter.
                state[f"optim.{item.name}.{key}"] = (
                    value.detach().clone()
                    if isinstance(value, torch.Tensor)
                    else torch.tensor(value)
                )
    return state


def _union(local: dict[str, dict[str, str]], ranks: Ranks) -> dict[str, dict[str, str]]:
    gathered = ranks.all_gather(local)
    merged: dict[str, dict[str, str]] = {}
    for part in gathered:
        for name, keys in part.items():
            merged.setdefault(name, {}).update(keys)
    return merged


def _optimizer_targets(
    optimizer: ZeroOptimizer, slices: list[ParamSlice], metadata: dict[str, Any]
) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    for item in slices:
        if optimizer.shard_views.get(item.name) is None:
            continue
        prefix = f"optim.{item.name}."
        begin, end = item.local_range()
        for key, meta in metadata.items():
            if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
                continue
            dtype = meta.properties.dtype
            if list(meta.size) == [item.numel] and item.numel > 1:
                targets[key] = _sharded(item, torch.empty(end - begin, dtype=dtype))
            else:
                targets[key] = torch.empty(meta.size, dtype=dtype)
    return targets


def _restore_optimizer(
    optimizer: ZeroOptimizer,
    slices: list[ParamSlice],
    state: dict[str, Any],
    objects: dict[str, Any],
) -> None:
    groups = objects["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint optimizer has {len(groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update(saved)
    optimizer.optim.state.clear()
    for item in slices:
        view = optimizer.shard_views.get(item.name)
        if view is None:
            continue
        prefix = f"optim.{item.name}."
        per_param: dict[str, Any] = {}
        for key, value in state.items():
            if key.startswith(prefix):
                loaded = local_part(value) if isinstance(value, ShardedTensor) else value
                per_param[key[len(prefix) :]] = (
                    loaded.to(view.device) if loaded is not None else None
                )
        if per_param:
            optimizer.optim.state[view] = per_param
    optimizer.state_replaced()
    optimizer.grad_scaler.load_state_dict(objects["grad_scaler"])
