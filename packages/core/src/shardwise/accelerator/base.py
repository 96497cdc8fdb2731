"""BaseAccelerator: the methods of ColossalAI's `BaseAccelerator` that training scripts call, one
implementation per device kind (cuda.py, cpu.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any

import torch


class BaseAccelerator(ABC):
    """A device kind: where tensors go, its random generator, memory counters, autocast.

    Args:
        name: "cuda" or "cpu".
        communication_backend: the torch.distributed backend for it ("nccl", "gloo").
        is_synchronous: whether work on it finishes before the call returns.
    """

    support_set_device: bool = True

    def __init__(self, name: str, communication_backend: str, is_synchronous: bool) -> None:
        self._name = name
        self._communication_backend = communication_backend
        self._is_synchronous = is_synchronous

    @property
    def name(self) -> str:
        return self._name

    @property
    def communication_backend(self) -> str:
        return self._communication_backend

    @property
    def is_synchronous(self) -> bool:
        return self._is_synchronous

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._name}, communication_backend="
            f"{self._communication_backend}, is_synchronous={self._is_synchronous})"
        )

    def set_to_device(self, models: Any) -> Any:
        """`models` (a module, or a list of modules) moved to the current device."""
        device = self.get_current_device()
        if isinstance(models, list):
            moved = [model.to(device) for model in models]
            return moved if len(moved) > 1 else moved[0]
        return models.to(device)

    @abstractmethod
    def get_version(self) -> str: ...

    @abstractmethod
    def get_current_device(self) -> torch.device: ...

    @abstractmethod
    def current_device(self) -> int: ...

    @abstractmethod
    def set_device(self, device: torch.device | int | None = None) -> None: ...

    @abstractmethod
    def get_device_name(self, device: torch.device | int | None = None) -> str: ...

    @abstractmethod
    def synchronize(self, device: torch.device | int | None = None) -> None: ...

    @abstractmethod
    def is_available(self) -> bool: ...

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def get_rng_state(self, device: Any = None) -> torch.Tensor: ...

    @abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device: Any = None) -> None: ...

    @abstractmethod
    def manual_seed(self, seed: int) -> None: ...

    @abstractmethod
    def manual_seed_all(self, seed: int) -> None: ...

    @abstractmethod
    def initial_seed(self) -> int: ...

    @abstractmethod
    def empty_cache(self) -> None: ...

    @abstractmethod
    def memory_allocated(self, device: Any = None) -> int: ...

    @abstractmethod
    def max_memory_allocated(self, device: Any = None) -> int: ...

    @abstractmethod
    def reset_peak_memory_stats(self, device: Any = None) -> None: ...

    def reset_max_memory_allocated(self, device: Any = None) -> None:
        self.reset_peak_memory_stats(device)

    @abstractmethod
    def memory_reserved(self, device: Any = None) -> int: ...

    @abstractmethod
    def max_memory_reserved(self, device: Any = None) -> int: ...

    @abstractmethod
    def autocast(
        self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True
    ) -> AbstractContextManager[Any]: ...
