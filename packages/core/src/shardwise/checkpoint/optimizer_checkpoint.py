"""An optimizer's state in ColossalAI's layout: torch's optimizer state dict (`state` keyed by
parameter number, every tensor of its parameter's whole shape; `param_groups` with those
numbers), so it does not depend on world size, stage or plugin, and torch's own optimizers
load it. One file (`torch.save` of the dict), or a directory of `pytorch_optim-NNNNN.bin`
files (parameter number -> its state), `pytorch_optim_group.bin` (the groups) and
`pytorch_optim.bin.index.json`. The loss scaler's state rides along under `loss_scaler` (a
key torch's `load_state_dict` does not read)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.commit import CheckpointError, Ranks
from shardwise.checkpoint.file_names import INDEX_SUFFIX, STATES_INDEX_NAME, optimizer_file_names
from shardwise.checkpoint.file_plan import plan_files
from shardwise.checkpoint.file_writer import FileWriter, publish, start_writing
from shardwise.checkpoint.model_checkpoint import check_size_per_shard
from shardwise.torch_files import load_torch_file

# Flags of the optimizer that saved (which kernel it ran), not hyper-parameters: a loaded
# optimizer keeps its own.
IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def state_bytes(state: Mapping[str, Any]) -> int:
    return sum(
        v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 8 for v in state.values()
    )


def write_optimizer_checkpoint(
    checkpoint: str | Path,
    ranks: Ranks,
    sizes: Sequence[tuple[int, int]],
    offer: Callable[[FileWriter], None],
    param_groups: list[dict[str, Any]],
    loss_scaler: dict[str, Any] | None,
    *,
    shard: bool,
    prefix: str | None,
    size_per_shard: float,
) -> None:
    """Write the per-parameter states named in `sizes` (number, bytes) that `offer` hands the
    writer (keys are `str(number)`; every rank calls it), with `param_groups` (torch's, with
    parameter numbers) and the loss scaler's state."""
    target = Path(checkpoint)
    max_bytes = check_size_per_shard(size_per_shard)
    keyed = [(str(number), nbytes) for number, nbytes in sizes]
    if shard:
        base, index_name, group_file = optimizer_file_names(prefix)
        plan = plan_files(keyed, max_file_bytes=max_bytes, world_size=ranks.world, shard_name=base)
        stem = re.escape(base.rpartition(".")[0])
        stale: re.Pattern[str] | None = re.compile(rf"{stem}-\d{{5}}\.bin")
        metadata = {"param_groups": group_file}
        if loss_scaler is not None:
            metadata["loss_scaler"] = loss_scaler  # type: ignore[assignment]
        writer = FileWriter(target, plan, ranks.rank, _write_states)
        start_writing(target, ranks)
        offer(writer)
        publish(
            writer,
            ranks,
            stale=stale,
            index=(index_name, metadata),
            on_rank_0=lambda where: torch.save(param_groups, where / group_file),
        )
        return
    if target.is_dir():
        raise ValueError(
            f"{target} is a directory: with shard=False the optimizer checkpoint is one file; "
            f"pass a file path, or shard=True to save into the directory"
        )
    plan = plan_files(keyed, max_file_bytes=max_bytes, world_size=1, file_name=target.name)

    def write_whole(contents: dict[str, Any], path: Path) -> None:
        whole: dict[str, Any] = {
            "state": {int(k): v for k, v in contents.items()},
            "param_groups": param_groups,
        }
        if loss_scaler is not None:
            whole["loss_scaler"] = loss_scaler
        torch.save(whole, path)

    writer = FileWriter(target.parent, plan, ranks.rank, write_whole)
    start_writing(target.parent, ranks)
    offer(writer)
    publish(writer, ranks)


def _write_states(contents: dict[str, Any], path: Path) -> None:
    torch.save({int(k): v for k, v in contents.items()}, path)


class OptimizerCheckpoint:
    """An optimizer checkpoint to read: its groups and loss scaler at once, each parameter's
    state when asked (files are memory-mapped, so only what is read is loaded)."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        loss_scaler: dict[str, Any] | None,
        whole: Mapping[int, Any] | None = None,
        root: Path | None = None,
        file_of: Mapping[int, str] | None = None,
    ) -> None:
        self.param_groups = param_groups
        self.loss_scaler = loss_scaler
        self._whole = dict(whole) if whole is not None else None
        self._root = root
        self._file_of = dict(file_of or {})
        self._files: dict[str, Any] = {}

    @classmethod
    def of_state_dict(
        cls, whole: Mapping[str, Any], where: str = "state_dict"
    ) -> OptimizerCheckpoint:
        """A torch optimizer state dict (whole-shape tensors), as `state_dict()` returns it."""
        if not isinstance(whole, Mapping) or "state" not in whole or "param_groups" not in whole:
            raise CheckpointError(
                f"{where} is not an optimizer state dict (it needs 'state' and 'param_groups')"
            )
        state = {int(k): v for k, v in whole["state"].items()}
        return cls(list(whole["param_groups"]), whole.get("loss_scaler"), whole=state)

    @classmethod
    def open(cls, path: str | Path) -> OptimizerCheckpoint:
        """The optimizer checkpoint at `path`: one file, or a directory with an index."""
        source = Path(path)
        if source.is_file():
            return cls.of_state_dict(load_torch_file(source), str(source))
        if not source.is_dir():
            raise CheckpointError(f"{source} does not exist: give an optimizer checkpoint")
        index = _optimizer_index(source)
        contents = json.loads(index.read_text())
        metadata = contents.get("metadata", {})
        if "param_groups" not in metadata:
            raise CheckpointError(f"{index} is not an optimizer index (no param_groups)")
        return cls(
            load_torch_file(source / metadata["param_groups"]),
            metadata.get("loss_scaler"),
            root=source,
            file_of={int(k): str(v) for k, v in contents["weight_map"].items()},
        )

    def numbers(self) -> list[int]:
        """The parameter numbers that have state."""
        return sorted(self._whole) if self._whole is not None else sorted(self._file_of)

    def state_of(self, number: int) -> dict[str, Any] | None:
        if self._whole is not None:
            return self._whole.get(number)
        name = self._file_of.get(number)
        if name is None:
            return None
        if name not in self._files:
            assert self._root is not None
            file = self._root / name
            if not file.is_file():
                raise CheckpointError(f"{file}, named by the optimizer index, is missing")
            self._files[name] = load_torch_file(file)
        state: dict[str, Any] | None = self._files[name].get(number)
        return state

    def check_groups(self, group_sizes: list[int]) -> None:
        """Raise unless the saved groups have the given numbers of parameters."""
        saved = [len(group["params"]) for group in self.param_groups]
        if saved != group_sizes:
            raise CheckpointError(
                f"the checkpoint's optimizer has parameter groups of {saved} parameters, this "
                f"one {group_sizes}: it was saved for another model or parameter grouping"
            )

    def hyperparameters(self, index: int, current: Mapping[str, Any]) -> dict[str, Any]:
        """Group `index`'s saved hyper-parameters over `current` (the loading optimizer's
        group), keeping its own parameters and implementation flags."""
        saved = self.param_groups[index]
        merged = dict(current)
        merged.update(
            {k: v for k, v in saved.items() if k != "params" and k not in IMPLEMENTATION_KEYS}
        )
        return merged


def _optimizer_index(directory: Path) -> Path:
    if (directory / STATES_INDEX_NAME).is_file():
        return directory / STATES_INDEX_NAME
    found = sorted(
        p for p in directory.glob(f"*{INDEX_SUFFIX}") if p.name.startswith("pytorch_optim")
    )
    if len(found) == 1:
        return found[0]
    if (directory / "optimizer.safetensors.index.json").is_file():
        raise CheckpointError(
            f"{directory} holds an optimizer saved with use_async (safetensors), which is not "
            f"read here: save it again with use_async=False"
        )
    raise CheckpointError(
        f"{directory} holds {'several' if found else 'no'} optimizer index "
        f"({STATES_INDEX_NAME}){': ' + ', '.join(p.name for p in found) if found else ''}"
    )
