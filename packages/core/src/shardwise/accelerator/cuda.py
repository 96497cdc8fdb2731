"""CudaAccelerator: `torch.cuda` behind ColossalAI's accelerator methods."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from shardwise.accelerator.base import BaseAccelerator


class CudaAccelerator(BaseAccelerator):
    """The current CUDA device of this process; collectives over nccl."""

    def __init__(self) -> None:
        super().__init__(name="cuda", communication_backend="nccl", is_synchronous=False)

    def get_version(self) -> str:
        return str(torch.version.cuda)

    def get_current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device: torch.device | int | None = None) -> None:
        """Bind this process to `device` (None: its rank modulo the devices on the node)."""
        if device is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "set_device() without a device needs torch.distributed initialised, to "
                    "pick the device by rank; pass the device"
                )
            device = dist.get_rank() % self.device_count()
        torch.cuda.set_device(device)

    def get_device_name(self, device: torch.device | int | None = None) -> str:
        return torch.cuda.get_device_name(device)

    def synchronize(self, device: torch.device | int | None = None) -> None:
        torch.cuda.synchronize(device)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def get_device_properties(self, device: Any) -> Any:
        return torch.cuda.get_device_properties(device)

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return torch.cuda.get_rng_state(device)

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.cuda.set_rng_state(new_state, device)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device: Any = None) -> int:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device: Any = None) -> int:
        return torch.cuda.max_memory_allocated(device)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def memory_reserved(self, device: Any = None) -> int:
        return torch.cuda.memory_reserved(device)

    def max_memory_reserved(self, device: Any = None) -> int:
        return torch.cuda.max_memory_reserved(device)

    def Stream(  # ColossalAI's name
        self, device: Any = None, priority: int = 0, **kwargs: Any
    ) -> torch.cuda.Stream:
        return torch.cuda.Stream(device, priority, **kwargs)

    def current_stream(self, device: Any = None) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def stream(self, stream_: torch.cuda.Stream | None) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream_)

    def autocast(
        self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True
    ) -> AbstractContextManager[Any]:
        return torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
