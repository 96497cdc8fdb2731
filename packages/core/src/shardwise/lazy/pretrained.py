"""`from_pretrained` inside `LazyInitContext`: the model is built lazily from its configuration
and each of its tensors is read from the checkpoint files only when its module is materialised.

[Note: pretrained weights, lazily]
transformers' own `from_pretrained` builds on the meta device and then loads every tensor, so
each rank would hold the whole model in host memory. Inside the context it is replaced (as
ColossalAI's PretrainedManager does) by: the configuration, as transformers loads it; the model
built lazily from it (`_from_config`, the dtype transformers would pick); then, for each of
its state-dict tensors found in the checkpoint, a last write "load this key" recorded on it
(see [Note: lazy recipes] in recipe.py), which makes every earlier initialisation of it dead.
A safetensors file is read a tensor at a time. Keys are matched as saved, or with the base
model's prefix added or removed (a checkpoint of the base model loaded into one with a head);
what the checkpoint lacks keeps the model's own initialisation (drawn when materialised),
what the model lacks is not read, and both are logged, as transformers does. Loading
arguments that change what is built or read (device maps, quantisation, adapters, state
dicts, GGUF files, variants) are refused.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardwise.lazy.recipe import TARGET, Call, Write, geometry_of, root_of
from shardwise.lazy.recorder import Recorder
from shardwise.torch_files import load_torch_file

_log = logging.getLogger(__name__)

Unpatch = Callable[[], None]

_DOWNLOAD = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "revision",
    "subfolder",
    "token",
)
# Accepted and without effect here: transformers' own markers and settings of how it reads.
_IGNORED = (
    "_from_auto",
    "_from_pipeline",
    "_commit_hash",
    "trust_remote_code",
    "low_cpu_mem_usage",
    "weights_only",
    "disable_mmap",
    "mirror",
    "_fast_init",
)
_REFUSED = (
    "device_map",
    "max_memory",
    "offload_folder",
    "offload_buffers",
    "offload_state_dict",
    "quantization_config",
    "load_in_8bit",
    "load_in_4bit",
    "state_dict",
    "gguf_file",
    "variant",
    "adapter_name",
    "tp_plan",
    "tp_size",
    "device_mesh",
    "distributed_config",
    "key_mapping",
    "from_tf",
    "from_flax",
    "use_kernels",
    "kernel_config",
    "fusion_config",
)


def patch_from_pretrained(recorder: Recorder) -> Unpatch:
    """Replace `PreTrainedModel.from_pretrained` while the context is open, when transformers
    is imported (a model class at hand means it is); returns what puts it back."""
    if "transformers" not in sys.modules:
        return lambda: None
    modeling = importlib.import_module("transformers.modeling_utils")
    model_class = modeling.PreTrainedModel
    original = model_class.__dict__["from_pretrained"]

    def lazy_from_pretrained(cls: Any, name_or_path: Any, *model_args: Any, **kwargs: Any) -> Any:
        return _from_pretrained(recorder, cls, name_or_path, model_args, kwargs)

    model_class.from_pretrained = classmethod(lazy_from_pretrained)

    def unpatch() -> None:
        model_class.from_pretrained = original

    return unpatch


def _from_pretrained(
    recorder: Recorder,
    cls: Any,
    name_or_path: Any,
    model_args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    from transformers import GenerationConfig, PretrainedConfig

    _refuse(cls, kwargs)
    download = {k: kwargs.pop(k) for k in _DOWNLOAD if k in kwargs}
    for key in _IGNORED:
        kwargs.pop(key, None)
    adapter = kwargs.pop("adapter_kwargs", None) or {}
    if "_adapter_model_path" in adapter:
        raise ValueError(
            f"{name_or_path} holds a peft adapter: under LazyInitContext build the base model, "
            f"then load the adapter with booster.enable_lora(model, pretrained_dir=...)"
        )
    use_safetensors = kwargs.pop("use_safetensors", None)
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None) or "auto"
    kwargs.pop("torch_dtype", None)
    generation_config = kwargs.pop("generation_config", None)
    attn = {k: kwargs.pop(k) for k in ("attn_implementation",) if k in kwargs}
    config = kwargs.pop("config", None)
    if not isinstance(config, PretrainedConfig):
        config, kwargs = cls.config_class.from_pretrained(
            config if config is not None else name_or_path,
            return_unused_kwargs=True,
            **download,
            **kwargs,
        )
    if dtype == "auto":
        dtype = config.dtype if getattr(config, "dtype", None) is not None else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    config.name_or_path = str(name_or_path)
    files = _checkpoint_files(str(name_or_path), download, use_safetensors)
    # The checkpoint replaces these initialisations, so they need not follow the random stream
    # (transformers' own loading does not either).
    exact, recorder.exact_random = recorder.exact_random, False
    try:
        model = (
            cls._from_config(config, dtype=dtype, **attn, **kwargs)
            if not model_args
            else cls(config, *model_args, **kwargs)
        )
    finally:
        recorder.exact_random = exact
    _bind(model, files, str(name_or_path))
    model.eval()
    # Without a generation_config.json the one built from the model's config stays.
    if model.can_generate():
        with contextlib.suppress(OSError):
            model.generation_config = generation_config or GenerationConfig.from_pretrained(
                name_or_path, **download
            )
    return model


def _refuse(cls: Any, kwargs: dict[str, Any]) -> None:
    refused = sorted(k for k in _REFUSED if kwargs.get(k) not in (None, False, {}, "default", ""))
    if kwargs.get("output_loading_info") or kwargs.get("ignore_mismatched_sizes"):
        refused += [k for k in ("output_loading_info", "ignore_mismatched_sizes") if kwargs.get(k)]
    if refused:
        raise ValueError(
            f"{cls.__name__}.from_pretrained inside LazyInitContext cannot honour {refused}: "
            f"the weights are read unchanged, on every rank, as each module is materialised; "
            f"call from_pretrained outside the context for these"
        )
    for key in (*_REFUSED, "output_loading_info", "ignore_mismatched_sizes"):
        kwargs.pop(key, None)


class _Checkpoint:
    """The tensors of a checkpoint, read one at a time: key -> file."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self._loaded: dict[Path, dict[str, torch.Tensor]] = {}

    def read(self, key: str) -> torch.Tensor:
        path = self.files[key]
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as handle:
                tensor: torch.Tensor = handle.get_tensor(key)
                return tensor
        if path not in self._loaded:  # a pickle is read whole (memory-mapped where it can be)
            self._loaded[path] = load_torch_file(path)
        return self._loaded[path][key]


def load_pretrained_(target: torch.Tensor, checkpoint: _Checkpoint, key: str) -> torch.Tensor:
    """The recorded write that gives a tensor its checkpoint value (named to overwrite: see
    `OVERWRITING` in recipe.py)."""
    value = checkpoint.read(key)
    if value.shape != target.shape:
        raise ValueError(
            f"{key}: the checkpoint has shape {tuple(value.shape)}, the model "
            f"{tuple(target.shape)}; was the model built from the checkpoint's config?"
        )
    return target.copy_(value)


def _bind(model: Any, checkpoint: _Checkpoint, source: str) -> None:
    with torch._C.DisableTorchFunction():  # bookkeeping, not the model's code: not recorded
        _bind_keys(model, checkpoint, source)


def _bind_keys(model: Any, checkpoint: _Checkpoint, source: str) -> None:
    saved = set(checkpoint.files)
    prefix = getattr(model, "base_model_prefix", "") or ""
    bound: set[int] = set()
    used: set[str] = set()
    missing: list[str] = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = _saved_key(name, prefix, saved)
        if key is None:
            if id(tensor) not in bound:
                missing.append(name)
            continue
        used.add(key)
        root = root_of(tensor)
        if root is None or id(tensor) in bound:
            continue
        bound.add(id(tensor))
        call = Call(load_pretrained_, (TARGET, checkpoint, key), {}, torch.get_default_dtype())
        root.writes.append(Write(geometry_of(tensor), call))
    unused = sorted(saved - used)
    if missing:
        _log.warning(
            "%s: %d tensors are not in the checkpoint at %s and keep the model's own "
            "initialisation: %s",
            type(model).__name__,
            len(missing),
            source,
            missing[:10],
        )
    if unused:
        _log.warning(
            "%s: %d tensors of the checkpoint at %s are not in the model: %s",
            type(model).__name__,
            len(unused),
            source,
            unused[:10],
        )


def _saved_key(name: str, prefix: str, saved: set[str]) -> str | None:
    candidates = [name]
    if prefix:
        candidates += [name.removeprefix(f"{prefix}."), f"{prefix}.{name}"]
    return next((key for key in candidates if key in saved), None)


def _checkpoint_files(
    name_or_path: str, download: dict[str, Any], use_safetensors: bool | None
) -> _Checkpoint:
    """Key -> file for a local directory or a Hub model id (through transformers' cache)."""
    from transformers.utils.hub import cached_file

    names = ["model.safetensors.index.json", "model.safetensors"]
    if use_safetensors is not True:
        names += ["pytorch_model.bin.index.json", "pytorch_model.bin"]
    if use_safetensors is False:
        names = names[2:]
    for file_name in names:
        found = cached_file(
            name_or_path, file_name, _raise_exceptions_for_missing_entries=False, **download
        )
        if found is None:
            continue
        path = Path(found)
        if file_name.endswith(".index.json"):
            weight_map: dict[str, str] = json.loads(path.read_text())["weight_map"]
            # Each shard through the cache too (a Hub model fetches them; a directory has them).
            shards = {file: _cached(name_or_path, file, download) for file in weight_map.values()}
            return _Checkpoint({key: shards[file] for key, file in weight_map.items()})
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                return _Checkpoint({key: path for key in handle.keys()})  # noqa: SIM118
        state = torch.load(path, map_location="meta", weights_only=True)
        return _Checkpoint({key: path for key in state})
    raise ValueError(
        f"no weights found for {name_or_path!r} (looked for {names}"
        f"{' in ' + os.fspath(name_or_path) if Path(name_or_path).is_dir() else ''})"
    )


def _cached(name_or_path: str, file_name: str, download: dict[str, Any]) -> Path:
    from transformers.utils.hub import cached_file

    found = cached_file(name_or_path, file_name, **download)
    if found is None:
        raise ValueError(f"{name_or_path!r} lists {file_name} in its index, which is not there")
    return Path(found)
