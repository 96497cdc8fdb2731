"""Hugging Face format: a consolidated, unpadded safetensors export, and a sharded import.

Export gathers one chunk at a time and rank 0 writes files of at most `max_shard_bytes`, with
`model.safetensors.index.json` when there is more than one, so any `safetensors` or
`transformers` user loads the model without shardwise. Import reads, on each rank, only the
rows of each tensor that cover the elements the rank owns.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from shardwise import comm
from shardwise.checkpoint.commit import CheckpointError
from shardwise.checkpoint.layout import param_slices
from shardwise.engine.model import ZeroModel
from shardwise.engine.state_dict import gather_parameters

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            "the Hugging Face format needs the safetensors package: pip install 'shardwise[hf]'"
        ) from None
    return safetensors


def export_hf(
    path: str | os.PathLike[str],
    model: ZeroModel,
    *,
    max_shard_bytes: int = 5 * 1024**3,
    dtype: torch.dtype | None = None,
) -> None:
    """Write the whole model to directory `path` in Hugging Face safetensors format. A
    collective; rank 0 writes. Tied parameters are written once (under their first name), as
    `save_pretrained` does; a module with a Hugging Face `config` gets its `config.json` too.

    Args:
        path: output directory (replaced atomically if it exists).
        model: the wrapped model.
        max_shard_bytes: files are split above this size, with an index file.
        dtype: cast floating tensors to this dtype (default: fp32 masters as they are).
    """
    if (
        isinstance(max_shard_bytes, bool)
        or not isinstance(max_shard_bytes, int)
        or max_shard_bytes < 1
    ):
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    safetensors = _safetensors()
    target = Path(path)
    rank = comm.rank(model.config.topology.process_group)
    staging = target.parent / f".{target.name}.partial"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    tensors = _gathered_tensors(model, dtype)
    if rank == 0:
        files: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if files[-1] and size + nbytes > max_shard_bytes:
                files.append({})
                size = 0
            files[-1][name] = tensor
            size += nbytes
        weight_map = {}
        for number, part in enumerate(files, start=1):
            file_name = (
                SINGLE_FILE
                if len(files) == 1
                else f"model-{number:05d}-of-{len(files):05d}.safetensors"
            )
            safetensors.torch.save_file(part, str(staging / file_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file_name))
        if len(files) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        config: Any = getattr(model.module, "config", None)
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(str(staging))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    if torch.distributed.is_initialized():
        torch.distributed.barrier(model.config.topology.process_group)


def _gathered_tensors(model: ZeroModel, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Every parameter (once) and persistent buffer, whole, on rank 0's CPU; one chunk is
    gathered at a time."""
    keep = comm.rank(model.config.topology.process_group) == 0
    by_param = gather_parameters(model.chunk_manager, keep=keep, dtype=dtype)
    tensors: dict[str, torch.Tensor] = {}
    if not keep:
        return tensors
    for name, param in model.module.named_parameters():
        tensors[name] = by_param[id(param)]
    persistent = set(model.module.state_dict(keep_vars=True))
    for name, buffer in model.module.named_buffers():
        if name in persistent:
            tensors[name] = buffer.detach().to("cpu", copy=True).contiguous()
    return tensors


def load_hf(path: str | os.PathLike[str], model: ZeroModel, *, strict: bool = True) -> None:
    """Load a Hugging Face safetensors model (one file or an index) into the sharded `model`;
    each rank reads only the rows holding elements it owns. Tied parameters may appear under
    any of their names. With `strict`, a parameter missing from the files is an error."""
    safetensors = _safetensors()
    source = Path(path)
    if (source / INDEX_FILE).is_file():
        weight_map: dict[str, str] = json.loads((source / INDEX_FILE).read_text())["weight_map"]
    elif (source / SINGLE_FILE).is_file():
        with safetensors.safe_open(str(source / SINGLE_FILE), framework="pt") as handle:
            weight_map = dict.fromkeys(handle.keys(), SINGLE_FILE)
    else:
        raise CheckpointError(f"{source} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    names_of: dict[int, list[str]] = {}
    for name, param in model.module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    with ExitStack() as stack:
        handles: dict[str, Any] = {}

        def open_file(file: str) -> Any:
            if file not in handles:
                handles[file] = stack.enter_context(
                    safetensors.safe_open(str(source / file), framework="pt")
                )
            return handles[file]

        for item in param_slices(model):
            param = item.chunk.tensors[item.index].param
            found = [n for n in names_of[id(param)] if n in weight_map]
            if not found:
                if strict:
                    raise CheckpointError(f"{source} has no tensor for parameter {item.name!r}")
                continue
            name = found[0]
            file = weight_map[name]
            handle = open_file(file)
            shape = list(handle.get_slice(name).get_shape())
            if shape != list(item.shape):
                raise CheckpointError(
                    f"{name} has shape {shape} in {file}, the model has {list(item.shape)}"
                )
            begin, end = item.local_range()
            if end > begin:
                item.chunk.write_range(
                    item.index, begin, _read_flat_range(handle, name, shape, begin, end)
                )
        for name, buffer in model.module.named_buffers():
            if name in weight_map:
                with torch.no_grad():
                    buffer.copy_(open_file(weight_map[name]).get_tensor(name))
    for chunk in model.chunk_manager.chunks:
        chunk.payload.refresh_gathered()


def _read_flat_range(
    handle: Any, name: str, shape: list[int], begin: int, end: int
) -> torch.Tensor:
    """Elements [begin, end) of the flattened tensor, reading only the rows that hold them."""
    if len(shape) <= 1:
        values: torch.Tensor = handle.get_slice(name)[begin:end].reshape(-1)
        return values
    row = 1
    for size in shape[1:]:
        row *= size
    first, last = begin // row, (end - 1) // row + 1
    rows: torch.Tensor = handle.get_slice(name)[first:last].reshape(-1)
    return rows[begin - first * row : end - first * row]
