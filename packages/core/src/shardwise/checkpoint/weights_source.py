"""Reading a model's weights from any checkpoint a user may hand over: one `.safetensors` or
torch file, or a directory holding an index (Hugging Face's, ColossalAI's, shardwise's, with
or without a prefix) or a single weights file. Only the rows asked for are read: safetensors
slices its files, torch files are memory-mapped."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from shardwise.checkpoint.commit import CheckpointError
from shardwise.checkpoint.file_names import (
    GROUP_FILE_NAME,
    INDEX_SUFFIX,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    STATES_INDEX_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)
from shardwise.torch_files import load_torch_file


def safetensors_module() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            "safetensors files need the safetensors package: pip install 'shardwise[hf]'"
        ) from None
    return safetensors


def weights_files(path: Path) -> dict[str, str]:
    """Key -> file (relative to the directory, or the file itself) of the weights at `path`."""
    if path.is_file():
        if path.name.endswith(INDEX_SUFFIX):
            return _index_map(path)
        return dict.fromkeys(_keys_of_file(path), path.name)
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist: give a checkpoint file or directory")
    for name in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        if (path / name).is_file():
            return _index_map(path / name)
    prefixed = sorted(
        p
        for p in path.glob(f"*{INDEX_SUFFIX}")
        if not p.name.startswith(STATES_INDEX_NAME.split(".")[0])
        and not p.name.startswith("optimizer")
    )
    if len(prefixed) == 1:
        return _index_map(prefixed[0])
    if len(prefixed) > 1:
        raise CheckpointError(
            f"{path} holds several weight indexes ({', '.join(p.name for p in prefixed)}): "
            f"give the path of the one to load"
        )
    for name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
        if (path / name).is_file():
            return dict.fromkeys(_keys_of_file(path / name), name)
    if any(path.glob(f"{STATES_INDEX_NAME.split('.')[0]}*{INDEX_SUFFIX}")):
        raise CheckpointError(
            f"{path} holds an optimizer's state, not model weights: load it with load_optimizer"
        )
    found = sorted(p.name for p in path.iterdir())[:8]
    raise CheckpointError(
        f"{path} holds no model weights (no {SAFE_WEIGHTS_INDEX_NAME}, {WEIGHTS_INDEX_NAME}, "
        f"{SAFE_WEIGHTS_NAME} or {WEIGHTS_NAME}); it has {found}"
    )


def _index_map(index: Path) -> dict[str, str]:
    contents = json.loads(index.read_text())
    weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} is not a weights index (it has no weight_map)")
    if GROUP_FILE_NAME.split(".")[0] in json.dumps(contents.get("metadata", {})):
        raise CheckpointError(f"{index} indexes an optimizer's state, not a model's weights")
    return {str(key): str(file) for key, file in weight_map.items()}


def _keys_of_file(file: Path) -> list[str]:
    if file.suffix == ".safetensors":
        with safetensors_module().safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    contents = load_torch_file(file)
    if not isinstance(contents, dict):
        raise CheckpointError(f"{file} does not hold a state dict")
    return list(contents)


class WeightsSource(AbstractContextManager["WeightsSource"]):
    """The weights at a checkpoint path; files are opened when first read, closed on exit."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file_of = weights_files(self.path)
        self._root = self.path.parent if self.path.is_file() else self.path
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stack.close()
        self._open.clear()

    def keys(self) -> list[str]:
        return list(self.file_of)

    def _file(self, key: str) -> tuple[str, Any]:
        name = self.file_of[key]
        if name not in self._open:
            file = self._root / name
            if not file.is_file():
                raise CheckpointError(f"{file}, named by the index for {key!r}, is missing")
            if file.suffix == ".safetensors":
                self._open[name] = self._stack.enter_context(
                    safetensors_module().safe_open(str(file), framework="pt")
                )
            else:
                self._open[name] = load_torch_file(file)
        return name, self._open[name]

    def shape(self, key: str) -> list[int]:
        name, handle = self._file(key)
        if name.endswith(".safetensors"):
            return list(handle.get_slice(key).get_shape())
        return list(_tensor_in(handle, key, name).shape)

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor."""
        name, handle = self._file(key)
        if name.endswith(".safetensors"):
            tensor: torch.Tensor = handle.get_tensor(key)
            return tensor
        return _tensor_in(handle, key, name)

    def read_flat_range(self, key: str, begin: int, end: int) -> torch.Tensor:
        """Elements [begin, end) of the flattened tensor, reading only the rows that hold
        them."""
        name, handle = self._file(key)
        if not name.endswith(".safetensors"):
            return _tensor_in(handle, key, name).reshape(-1)[begin:end]
        shape = list(handle.get_slice(key).get_shape())
        if len(shape) <= 1:
            values: torch.Tensor = handle.get_slice(key)[begin:end]
            return values.reshape(-1)
        row = 1
        for size in shape[1:]:
            row *= size
        first, last = begin // row, (end - 1) // row + 1
        rows: torch.Tensor = handle.get_slice(key)[first:last].reshape(-1)
        return rows[begin - first * row : end - first * row]


def _tensor_in(contents: Any, key: str, name: str) -> torch.Tensor:
    value = contents.get(key) if isinstance(contents, dict) else None
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{name} has no tensor {key!r}")
    return value
