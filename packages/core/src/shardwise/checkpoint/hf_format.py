"""Hugging Face format: a consolidated, unpadded safetensors export that rank 0 writes (as
`save_pretrained` does: tied weights once, `model.safetensors` or numbered files with an
index), and a sharded import (see zero_model_io.py). The Booster's `save_model` writes the
same layout from every rank at once (see model_checkpoint.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from shardwise import comm
from shardwise.checkpoint.saved_module import saved_module
from shardwise.checkpoint.weights_source import safetensors_module
from shardwise.checkpoint.zero_model_io import load_zero_model
from shardwise.engine.model import ZeroModel
from shardwise.engine.state_dict import gather_parameters

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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
    safetensors = safetensors_module()
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
        config: Any = getattr(saved_module(model.module), "config", None)
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
    module = saved_module(model.module)
    for name, param in module.named_parameters():
        tensors[name] = by_param[id(param)]
    persistent = set(module.state_dict(keep_vars=True))
    for name, buffer in module.named_buffers():
        if name in persistent:
            tensors[name] = buffer.detach().to("cpu", copy=True).contiguous()
    return tensors


def load_hf(path: str | os.PathLike[str], model: ZeroModel, *, strict: bool = True) -> None:
    """Load a Hugging Face model directory (safetensors or torch files, one or an index) into
    the sharded `model`; each rank reads only the rows holding elements it owns. Tied
    parameters may appear under any of their names. With `strict`, a key missing from the
    files, or one the model lacks, is an error."""
    load_zero_model(model, Path(path), strict=strict)
