"""A ZeRO model's weights to and from Hugging Face-format files (see model_checkpoint.py):
each chunk is gathered in turn and every rank keeps only the tensors of its own files; on load
every rank reads only the elements it owns."""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.checkpoint.commit import CheckpointError, Ranks
from shardwise.checkpoint.file_writer import FileWriter
from shardwise.checkpoint.layout import param_slices
from shardwise.checkpoint.model_checkpoint import write_model_checkpoint
from shardwise.checkpoint.saved_module import saved_module
from shardwise.checkpoint.weights_source import WeightsSource
from shardwise.engine.model import ZeroModel
from shardwise.engine.state_dict import gathered_chunks


def ranks_of(model: ZeroModel) -> Ranks:
    return Ranks(model.comm_stats, model.config.topology.process_group)


def save_zero_model(
    model: ZeroModel,
    checkpoint: str | Path,
    *,
    shard: bool,
    prefix: str | None = None,
    size_per_shard: float = 1024,
    use_safetensors: bool = False,
    tied_once: bool = False,
    dtype: torch.dtype | None = None,
) -> None:
    """Write `model`'s state dict (its module's names; trainable parameters as their fp32
    masters, frozen ones as stored, tied ones under every name, or with `tied_once` under the
    first only, as `save_pretrained` writes them) as one file that rank 0 writes, or with
    `shard` as a sharded directory every rank writes part of. `dtype` casts floating tensors.
    A collective."""
    manager = model.chunk_manager
    module = saved_module(model.module)
    state: dict[str, torch.Tensor] = {}
    kept: set[int] = set()  # the tensors named so far (state_dict() holds them alive)
    keys_of: dict[int, list[str]] = {}
    sizes: list[tuple[str, int]] = []
    for key, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"state dict entry {key!r} is a {type(value).__name__}, not a tensor: a weights "
                f"file holds tensors only"
            )
        if tied_once and id(value) in kept:
            continue
        kept.add(id(value))
        state[key] = value
        if manager.manages(value):
            chunk, index = manager.locate(value)
            stored = chunk.master if chunk.requires_grad else chunk.payload.shard
            keys_of.setdefault(id(value), []).append(key)
            numel, element_size = chunk.tensors[index].numel, stored.element_size()
            floating = stored.is_floating_point()
        else:
            numel, element_size = value.numel(), value.element_size()
            floating = value.is_floating_point()
        if dtype is not None and floating:
            element_size = dtype.itemsize
        sizes.append((key, numel * element_size))

    def saved(value: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
        return value.detach().to("cpu", dtype=cast, copy=True)

    def offer(writer: FileWriter) -> None:
        for key, value in state.items():
            if not manager.manages(value) and writer.wants(key):
                writer.add(key, saved(value))
        for chunk, full in gathered_chunks(manager):
            for info in chunk.tensors:
                for key in keys_of.get(id(info.param), ()):
                    if writer.wants(key):
                        writer.add(
                            key,
                            saved(full[info.offset : info.offset + info.numel]).view(info.shape),
                        )

    write_model_checkpoint(
        checkpoint,
        ranks_of(model),
        sizes,
        offer,
        shard=shard,
        prefix=prefix,
        size_per_shard=size_per_shard,
        use_safetensors=use_safetensors,
        config=getattr(module, "config", None),
    )


def load_zero_model(model: ZeroModel, checkpoint: str | Path, *, strict: bool = True) -> None:
    """Load the weights at `checkpoint` (see weights_source.py) into `model`: every rank reads
    the elements it owns. A tied parameter is found under any of its names. With `strict`, a
    key of the model missing from the files, or one of the files the model lacks, is an error
    (every rank reads the same index, so every rank raises alike)."""
    manager = model.chunk_manager
    expected = saved_module(model.module).state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for key, value in expected.items():
        if isinstance(value, torch.Tensor) and manager.manages(value):
            aliases.setdefault(id(value), []).append(key)
    with WeightsSource(checkpoint) as source:
        available = set(source.keys())
        missing = [
            key
            for key, value in expected.items()
            if key not in available and not available.intersection(aliases.get(id(value), ()))
        ]
        unexpected = sorted(available - set(expected))
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"{checkpoint} does not match the model: missing keys {missing[:8]}, "
                f"unexpected keys {unexpected[:8]}; pass strict=False to load the keys that "
                f"match"
            )
        for item in param_slices(model):
            param = item.chunk.tensors[item.index].param
            found = [key for key in aliases.get(id(param), ()) if key in available]
            if not found:
                continue
            _check_shape(source, found[0], list(item.shape))
            begin, end = item.local_range()
            if end > begin:
                values = source.read_flat_range(found[0], begin, end)
                item.chunk.write_range(item.index, begin, values.clone())
        for key, value in expected.items():
            if manager.manages(value) or key not in available:
                continue
            _check_shape(source, key, list(value.shape))
            with torch.no_grad():
                value.copy_(source.read(key))
    for chunk in manager.chunks:
        chunk.payload.refresh_gathered()


def _check_shape(source: WeightsSource, key: str, shape: list[int]) -> None:
    saved = source.shape(key)
    if saved != shape:
        raise CheckpointError(
            f"{key} has shape {saved} in {source.path}, but {shape} in the model: the "
            f"checkpoint is of another model"
        )
