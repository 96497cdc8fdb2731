"""One process reads a whole sharded checkpoint back: the single-file form other tools load.

[Note: consolidated checkpoints]
A sharded checkpoint (see checkpoint/api.py) keeps each parameter as a 1-D tensor split over
the ranks that saved it. Read without a process group, torch.distributed.checkpoint assembles
every entry whole in this process's memory; the manifest's `state_dict_keys` then names each
key of the module's own `state_dict()` (a tied weight under each of its names, persistent
buffers only), so the result loads with `module.load_state_dict(strict=True)`. The optimizer
state becomes torch's format (`{"state": {index: ...}, "param_groups": [...]}`) when the saver
recorded each parameter group's parameter names in its `extra` under `PARAM_GROUP_NAMES` (the
Lightning strategies do): torch numbers parameters by their place in the groups, which the
sharded optimizer no longer knows. Memory: the whole model (and optimizer state) at once.
"""

from __future__ import annotations

import io
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from shardwise.checkpoint.commit import CheckpointError, Ranks, read_manifest, verify_files
from shardwise.checkpoint.progress import ProgressLoadPlanner
from shardwise.logging.progress_bar import progress_wanted

# The key of a saver's `extra` (a dict) holding, per optimizer parameter group, the names of
# its parameters in group order (see [Note: consolidated checkpoints]).
PARAM_GROUP_NAMES = "shardwise_param_group_names"
# Where a consolidated checkpoint keeps what torch's formats have no place for.
SHARDWISE_KEY = "shardwise"
# Told a line at the start and end of each phase of a long read or write.
Progress = Callable[[str], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class WholeCheckpoint:
    """A sharded checkpoint read whole into one process.

    Attributes:
        state_dict: the module's state dict (fp32 masters for trainable parameters).
        optimizer: torch-format optimizer state dict, or None (no optimizer state saved, or
            no parameter-group names recorded to number the parameters by).
        grad_scaler: the loss scaler's state, when optimizer state was saved.
        extra: the saver's `extra`, without `PARAM_GROUP_NAMES`.
    """

    state_dict: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    grad_scaler: dict[str, Any] | None
    extra: Any


def read_whole(
    path: str | os.PathLike[str],
    *,
    optimizer: bool = True,
    verify_checksums: bool = True,
    progress: Progress | None = None,
) -> WholeCheckpoint:
    """Read the sharded checkpoint at `path` whole into this process, with no collective (any
    world size may have written it; a process group, if any, is not used).

    Args:
        path: the checkpoint (as given to `shardwise.checkpoint.save`).
        optimizer: also read the optimizer state.
        verify_checksums: check every file against the manifest first.
        progress: called with a line at the start and end of each phase (checking, reading),
            for a long read of a big model.
    """
    say = progress or (lambda line: None)
    source = Path(path)
    manifest = read_manifest(source)
    total = sum(entry["bytes"] for entry in manifest["files"].values())
    if verify_checksums:
        with _phase(
            say, f"checking {len(manifest['files'])} files ({_gib(total)}) against the manifest"
        ):
            verify_files(source, manifest, Ranks.alone())
    metadata = FileSystemReader(source).read_metadata().state_dict_metadata
    wanted = ("model.", "buffer.", "optim.") if optimizer else ("model.", "buffer.")
    state: dict[str, Any] = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata) and key.startswith(wanted)
    }
    state["objects"] = io.BytesIO()
    wanted_bytes = sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    with _phase(say, f"reading {_gib(wanted_bytes)} of tensors"), warnings.catch_warnings():
        # DCP warns that it loads in one process, which is the point here.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp_load(
            state,
            storage_reader=FileSystemReader(source),
            # A caller that follows the phases gets rank 0's bar of the bytes read as well.
            planner=ProgressLoadPlanner(bar=progress is not None and progress_wanted()),
            no_dist=True,
        )
    state["objects"].seek(0)
    objects = torch.load(state["objects"], weights_only=False)
    extra = objects["extra"]
    group_names = None
    if isinstance(extra, dict) and PARAM_GROUP_NAMES in extra:
        extra = dict(extra)
        group_names = extra.pop(PARAM_GROUP_NAMES)
    shapes = {name: torch.Size(shape) for name, shape in manifest["params"].items()}
    model = _module_state(manifest, state, shapes)
    optim_state = None
    if optimizer and manifest["has_optimizer"] and group_names is not None:
        optim_state = _optimizer_state(state, objects["param_groups"], group_names, shapes)
    return WholeCheckpoint(
        state_dict=model,
        optimizer=optim_state,
        grad_scaler=objects.get("grad_scaler") if manifest["has_optimizer"] else None,
        extra=extra,
    )


def lightning_checkpoint(whole: WholeCheckpoint) -> dict[str, Any]:
    """`whole` as the dict a Lightning `.ckpt` file holds: the saver's `extra` (Lightning's
    loops, callbacks, schedulers, hyper-parameters, ...) with `state_dict`, `optimizer_states`
    when there is optimizer state, and the loss scaler under "shardwise". An `extra` that is
    not a dict is kept under "extra"."""
    checkpoint: dict[str, Any] = (
        dict(whole.extra) if isinstance(whole.extra, Mapping) else {"extra": whole.extra}
    )
    checkpoint["state_dict"] = whole.state_dict
    if whole.optimizer is not None:
        checkpoint["optimizer_states"] = [whole.optimizer]
    if whole.grad_scaler is not None:
        checkpoint[SHARDWISE_KEY] = {"grad_scaler": whole.grad_scaler}
    return checkpoint


def consolidate(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    optimizer: bool = True,
    verify_checksums: bool = True,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write the sharded checkpoint `source` as one file `target` (`torch.save` of
    `lightning_checkpoint`), which `LightningModule.load_from_checkpoint` and `torch.load`
    read without shardwise; return what was written. The file is written beside `target` and
    renamed into place, so a crash leaves no half-written file.

    Args:
        source: the sharded checkpoint.
        target: the file to write (not an existing directory).
        optimizer: include the optimizer state (when the checkpoint can give it).
        verify_checksums: check the source's files against its manifest first.
        progress: called with a line at the start and end of each phase (checking, reading,
            writing): the command line prints them.
    """
    destination = Path(target)
    if destination.is_dir():
        raise ValueError(f"{destination} is a directory: name the file to write, e.g. model.ckpt")
    whole = read_whole(
        source, optimizer=optimizer, verify_checksums=verify_checksums, progress=progress
    )
    checkpoint = lightning_checkpoint(whole)
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.parent / f".{destination.name}.partial"
    with _phase(progress or (lambda line: None), f"writing {destination}"):
        torch.save(checkpoint, partial)
        os.replace(partial, destination)
    return checkpoint


@contextmanager
def _phase(say: Progress, what: str) -> Iterator[None]:
    say(f"{what} ...")
    started = time.perf_counter()
    yield
    say(f"{what}: done in {time.perf_counter() - started:.1f} s")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _module_state(
    manifest: dict[str, Any], state: dict[str, Any], shapes: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    keys: dict[str, str] | None = manifest.get("state_dict_keys")
    if keys is None:
        # Saved before the manifest named the state-dict keys: every parameter once, every
        # buffer (persistent or not).
        keys = {name: f"model.{name}" for name in manifest["params"]}
        keys.update({name: f"buffer.{name}" for name in manifest["buffers"]})
    module: dict[str, torch.Tensor] = {}
    for key, entry in keys.items():
        if entry not in state:
            raise CheckpointError(f"the checkpoint's files hold no {entry!r} (for {key!r})")
        value = state[entry]
        if entry.startswith("model."):
            value = value.view(shapes[entry[len("model.") :]])
        module[key] = value
    return module


def _optimizer_state(
    state: dict[str, Any],
    groups: list[dict[str, Any]],
    group_names: list[list[str]],
    shapes: dict[str, torch.Size],
) -> dict[str, Any]:
    if len(groups) != len(group_names):
        raise CheckpointError(
            f"the checkpoint has {len(groups)} optimizer parameter groups but names for "
            f"{len(group_names)}"
        )
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith("optim."):
            name, _, field = key[len("optim.") :].rpartition(".")
            per_param.setdefault(name, {})[field] = value
    torch_state: dict[int, dict[str, torch.Tensor]] = {}
    torch_groups = []
    index = 0
    for hyper, names in zip(groups, group_names, strict=True):
        numbers = []
        for name in names:
            fields = per_param.get(name, {})
            if fields:
                shape = shapes[name]
                # Sharded fields were saved flat (one element per parameter element).
                torch_state[index] = {
                    field: value.view(shape)
                    if value.dim() == 1 and value.numel() == shape.numel()
                    else value
                    for field, value in fields.items()
                }
            numbers.append(index)
            index += 1
        torch_groups.append({**hyper, "params": numbers})
    return {"state": torch_state, "param_groups": torch_groups}
