"""ColossalAI's `CheckpointIO`: saving and loading a model's weights, an optimizer's state and
an LR scheduler's, with ColossalAI 0.5's signatures; a subclass says how for its kind of model.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from shardwise.checkpoint.commit import CheckpointError, Ranks
from shardwise.comm import CommStats


class CheckpointIO(ABC):
    """Saves and loads in the layouts Hugging Face and ColossalAI use (see
    shardwise/checkpoint/file_names.py): a model as one file or a sharded directory with an
    index, an optimizer as torch's state dict with whole-shape state, one file or a directory.

    `gather_dtensor`, `use_async`, `low_cpu_mem_mode` and `num_threads` are accepted: there are
    no distributed tensors to keep apart, the files are complete when a save returns, and a
    load reads only what it keeps (torch files memory-mapped, safetensors sliced)."""

    @property
    def ranks(self) -> Ranks:
        """Every rank of the default group, or this process alone without one."""
        distributed = dist.is_available() and dist.is_initialized()
        return Ranks(CommStats()) if distributed else Ranks.alone()

    def save_model(
        self,
        model: nn.Module,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """The model's weights: one file, or with `shard` a directory of files of at most
        `size_per_shard` MB and their index (`prefix` goes into the file names)."""
        self._save_model(
            model,
            checkpoint,
            shard=shard,
            prefix=prefix,
            size_per_shard=size_per_shard,
            use_safetensors=use_safetensors,
        )

    def load_model(
        self,
        model: nn.Module,
        checkpoint: str,
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Weights from a file, or a directory with an index or one weights file."""
        self._load_model(model, checkpoint, strict=strict)

    def save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        """The optimizer's state: one file, or with `shard` a directory (see
        shardwise/checkpoint/optimizer_checkpoint.py)."""
        self._save_optimizer(
            optimizer, checkpoint, shard=shard, prefix=prefix, size_per_shard=size_per_shard
        )

    def load_optimizer(
        self,
        optimizer: Any,
        checkpoint: str,
        prefix: str | None = None,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        self._load_optimizer(optimizer, checkpoint)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        """Write `lr_scheduler.state_dict()` to the file `checkpoint`: rank 0 writes it whole or
        not at all; every rank returns once it is there, or raises what rank 0 met."""
        path = Path(checkpoint)
        ranks = self.ranks
        problem: str | None = None
        if ranks.rank == 0:
            try:
                if path.is_dir():
                    raise ValueError(f"{checkpoint} is a directory: give the file to write")
                partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
                torch.save(lr_scheduler.state_dict(), partial)
                os.replace(partial, path)
            except (OSError, ValueError) as error:
                problem = f"{type(error).__name__}: {error}"
        # Rank 0's outcome reaches every rank, so none waits for a file that never comes.
        problem = ranks.from_first(problem)
        if problem is not None:
            raise CheckpointError(f"save_lr_scheduler failed on rank 0: {problem}")

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        """Load the state `save_lr_scheduler` wrote into `lr_scheduler` (every rank reads)."""
        lr_scheduler.load_state_dict(torch.load(checkpoint, weights_only=True))

    @abstractmethod
    def _save_model(
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
    def _load_model(self, model: nn.Module, checkpoint: str, *, strict: bool) -> None: ...

    @abstractmethod
    def _save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str,
        *,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
    ) -> None: ...

    @abstractmethod
    def _load_optimizer(self, optimizer: Any, checkpoint: str) -> None: ...


def unwrapped_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer of a boosted optimizer (`unwrap()`), or `optimizer` itself."""
    inner = optimizer.unwrap() if hasattr(optimizer, "unwrap") else optimizer
    if not isinstance(inner, Optimizer):
        raise TypeError(
            f"optimizer must be a torch optimizer or the one booster.boost() returned, got "
            f"{type(optimizer).__name__}"
        )
    return inner
