"""The interface of a plugin's checkpoint IO (ColossalAI's `CheckpointIO`)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import nn

from shardwise.interface import OptimizerWrapper


class CheckpointIO(ABC):
    """Saves and loads a boosted model's weights and its optimizer's state in the layouts
    Hugging Face and ColossalAI use (see shardwise/checkpoint/file_names.py)."""

    @abstractmethod
    def save_model(
        self,
        model: nn.Module,
        checkpoint: str,
        *,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
        use_safetensors: bool,
    ) -> None: ...

    @abstractmethod
    def load_model(self, model: nn.Module, checkpoint: str, *, strict: bool) -> None: ...

    @abstractmethod
    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        *,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
    ) -> None: ...

    @abstractmethod
    def load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str) -> None: ...
