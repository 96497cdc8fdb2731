"""Hugging Face format: an export as `save_pretrained` writes a model (safetensors, tied
weights once, an index, `config.json`), and a sharded import. Both go through the Booster's
per-rank reader and writer (zero_model_io.py): no rank holds the whole model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shardwise.checkpoint.model_checkpoint import MEGABYTE
from shardwise.checkpoint.weights_source import safetensors_module
from shardwise.checkpoint.zero_model_io import load_zero_model, save_zero_model
from shardwise.engine.model import ZeroModel


def export_hf(
    path: str | os.PathLike[str],
    model: ZeroModel,
    *,
    max_shard_bytes: int = 5 * 1024**3,
    dtype: torch.dtype | None = None,
) -> None:
    """Write the whole model to directory `path` in Hugging Face safetensors format, for
    `from_pretrained`. A collective: every rank writes some of the files, gathering one chunk
    at a time (see model_checkpoint.py); a failed write raises on every rank. Tied parameters
    are written once (under their first name), as `save_pretrained` does; a module with a
    Hugging Face `config` gets its `config.json` too.

    Args:
        path: output directory; weights of an earlier export there are replaced.
        model: the wrapped model.
        max_shard_bytes: no file is larger than this (each is also at most a world-size-th
            of the whole, so that every rank writes some); the index names every file.
        dtype: cast floating tensors to this dtype (default: fp32 masters as they are).
    """
    if (
        isinstance(max_shard_bytes, bool)
        or not isinstance(max_shard_bytes, int)
        or max_shard_bytes < 1
    ):
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    safetensors_module()  # a clear error naming the package when it is missing
    save_zero_model(
        model,
        Path(path),
        shard=True,
        size_per_shard=max_shard_bytes / MEGABYTE,
        use_safetensors=True,
        tied_once=True,
        dtype=dtype,
    )


def load_hf(path: str | os.PathLike[str], model: ZeroModel, *, strict: bool = True) -> None:
    """Load a Hugging Face model directory (safetensors or torch files, one or an index) into
    the sharded `model`; each rank reads only the rows holding elements it owns. Tied
    parameters may appear under any of their names. With `strict`, a key missing from the
    files, or one the model lacks, is an error."""
    load_zero_model(model, Path(path), strict=strict)
