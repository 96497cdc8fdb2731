"""A model's weights as Hugging Face and ColossalAI write them: one file, or a sharded
directory with an index (see file_names.py), written by every rank in parallel (see
[Note: writing a sharded checkpoint])."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.commit import Ranks
from shardwise.checkpoint.file_names import model_file_names
from shardwise.checkpoint.file_plan import plan_files
from shardwise.checkpoint.file_writer import FileFormat, FileWriter, publish, start_writing
from shardwise.checkpoint.weights_source import safetensors_module

MEGABYTE = 1024**2


def check_size_per_shard(size_per_shard: object) -> int:
    """The file size limit in bytes, from `size_per_shard` in MB."""
    if isinstance(size_per_shard, bool) or not isinstance(size_per_shard, (int, float)):
        raise TypeError(f"size_per_shard must be a number of MB, got {size_per_shard!r}")
    if not size_per_shard > 0:
        raise ValueError(f"size_per_shard must be > 0 MB, got {size_per_shard}")
    return max(1, int(size_per_shard * MEGABYTE))


def tensor_file_format(use_safetensors: bool) -> FileFormat:
    if not use_safetensors:
        return lambda contents, path: torch.save(contents, path)
    save_file = safetensors_module().torch.save_file

    def write(contents: dict[str, Any], path: Path) -> None:
        save_file({k: v.contiguous() for k, v in contents.items()}, str(path), {"format": "pt"})

    return write


def write_model_checkpoint(
    checkpoint: str | Path,
    ranks: Ranks,
    sizes: Sequence[tuple[str, int]],
    offer: Callable[[FileWriter], None],
    *,
    shard: bool,
    prefix: str | None,
    size_per_shard: float,
    use_safetensors: bool,
    config: Any = None,
) -> None:
    """Write the tensors named in `sizes` (key, bytes, in state-dict order) that `offer` hands
    the writer (every rank calls it; it may run collectives), to the file `checkpoint`, or
    with `shard` into the directory `checkpoint`; a Hugging Face `config` (anything with
    `save_pretrained`) goes beside a sharded checkpoint as `config.json`.

    A sharded save replaces the weights of an earlier one of the same prefix, in either
    format, so that `from_pretrained` cannot read stale files instead of the new ones."""
    target = Path(checkpoint)
    max_bytes = check_size_per_shard(size_per_shard)
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str or None, got {type(prefix).__name__}")
    if shard:
        base, index_name = model_file_names(prefix, use_safetensors)
        plan = plan_files(sizes, max_file_bytes=max_bytes, world_size=ranks.world, shard_name=base)
        directory = target
        stale = _stale_weights(prefix)
        index: tuple[str, dict[str, Any]] | None = (index_name, {})
    else:
        if use_safetensors and target.suffix != ".safetensors":
            raise ValueError(
                f"use_safetensors=True writes a .safetensors file, got {target.name!r}: name "
                f"the file <name>.safetensors, or save with shard=True into a directory"
            )
        if target.is_dir():
            raise ValueError(
                f"{target} is a directory: with shard=False the checkpoint is one file; pass a "
                f"file path, or shard=True to save into the directory"
            )
        plan = plan_files(sizes, max_file_bytes=max_bytes, world_size=1, file_name=target.name)
        directory, stale, index = target.parent, None, None
    start_writing(directory, ranks)
    writer = FileWriter(directory, plan, ranks.rank, tensor_file_format(use_safetensors))
    offer(writer)
    save_config = None
    if shard and hasattr(config, "save_pretrained"):
        save_config = lambda where: config.save_pretrained(str(where))  # noqa: E731
    publish(writer, ranks, stale=stale, index=index, on_rank_0=save_config)


def _stale_weights(prefix: str | None) -> re.Pattern[str]:
    """The names of weights files and indexes an earlier save with `prefix` may have left."""
    names = []
    for use_safetensors in (False, True):
        base, index = model_file_names(prefix, use_safetensors)
        stem, _, suffix = base.rpartition(".")
        names += [
            re.escape(base),
            re.escape(index),
            rf"{re.escape(stem)}-\d{{5}}(-of-\d{{5}})?\.{suffix}",
        ]
    return re.compile("|".join(names))
