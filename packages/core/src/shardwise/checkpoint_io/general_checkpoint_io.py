"""ColossalAI's `GeneralCheckpointIO`: checkpoints of plain torch models, in one process or as
DDP replicas (TorchDDPPlugin): the same layouts as the ZeRO plugins', so either loads the
other's. Under torch.distributed every rank writes the files it was given from its own replica,
with no communication."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.checkpoint.commit import CheckpointError
from shardwise.checkpoint.file_writer import FileWriter
from shardwise.checkpoint.model_checkpoint import write_model_checkpoint
from shardwise.checkpoint.optimizer_checkpoint import (
    OptimizerCheckpoint,
    state_bytes,
    write_optimizer_checkpoint,
)
from shardwise.checkpoint.saved_module import saved_module
from shardwise.checkpoint.weights_source import WeightsSource
from shardwise.checkpoint_io.checkpoint_io_base import CheckpointIO, unwrapped_optimizer
from shardwise.interface import ModelWrapper


class GeneralCheckpointIO(CheckpointIO):
    def _save_model(
        self,
        model: nn.Module,
        checkpoint: str,
        *,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
        use_safetensors: bool,
    ) -> None:
        module = _unwrapped(model)
        state = {k: v.detach() for k, v in module.state_dict().items()}

        def offer(writer: FileWriter) -> None:
            for key, value in state.items():
                if writer.wants(key):
                    writer.add(key, value.to("cpu", copy=True))

        write_model_checkpoint(
            checkpoint,
            self.ranks,
            [(key, value.numel() * value.element_size()) for key, value in state.items()],
            offer,
            shard=shard,
            prefix=prefix,
            size_per_shard=size_per_shard,
            use_safetensors=use_safetensors,
            config=getattr(module, "config", None),
        )

    def _load_model(self, model: nn.Module, checkpoint: str, *, strict: bool) -> None:
        """Every rank reads the whole model (each holds one); a tied parameter is found under
        any of its names, as in the ZeRO plugins' load."""
        module = _unwrapped(model)
        expected = module.state_dict(keep_vars=True)
        names_of: dict[int, list[str]] = {}
        for key, value in expected.items():
            names_of.setdefault(id(value), []).append(key)
        with WeightsSource(checkpoint) as source:
            available = set(source.keys())
            state: dict[str, Any] = {}
            for key, value in expected.items():
                found = [name for name in names_of[id(value)] if name in available]
                if found:
                    state[key] = source.read(found[0])
            state.update({key: source.read(key) for key in available - set(expected)})
            try:
                module.load_state_dict(state, strict=strict)
            except RuntimeError as error:
                raise CheckpointError(f"{checkpoint} does not match the model: {error}") from None

    def _save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str,
        *,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
    ) -> None:
        whole = unwrapped_optimizer(optimizer).state_dict()
        states: dict[int, dict[str, Any]] = whole["state"]

        def offer(writer: FileWriter) -> None:
            for number, state in states.items():
                if writer.wants(str(number)):
                    writer.add(str(number), _to_cpu(state))

        write_optimizer_checkpoint(
            checkpoint,
            self.ranks,
            [(number, state_bytes(state)) for number, state in sorted(states.items())],
            offer,
            whole["param_groups"],
            None,
            shard=shard,
            prefix=prefix,
            size_per_shard=size_per_shard,
        )

    def _load_optimizer(self, optimizer: Any, checkpoint: str) -> None:
        inner = unwrapped_optimizer(optimizer)
        source = OptimizerCheckpoint.open(checkpoint)
        source.check_groups([len(group["params"]) for group in inner.param_groups])
        groups = []
        first = 0
        for index, group in enumerate(inner.param_groups):
            numbers = list(range(first, first + len(group["params"])))
            first += len(numbers)
            groups.append({**source.hyperparameters(index, group), "params": numbers})
        state = {}
        for number in range(first):
            saved = source.state_of(number)
            if saved is not None:
                state[number] = {
                    k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()
                }
        inner.load_state_dict({"state": state, "param_groups": groups})


def _unwrapped(model: nn.Module) -> nn.Module:
    return saved_module(model.unwrap() if isinstance(model, ModelWrapper) else model)


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in state.items()
    }
