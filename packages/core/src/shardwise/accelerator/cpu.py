"""CpuAccelerator: the host CPU behind ColossalAI's accelerator methods.

ColossalAI's own CPU accelerator raises for most of them (`synchronize`, `device_count`,
`manual_seed`, `empty_cache`, the memory counters), so a GPU script fails on a CPU host at its
first timing or memory line. Here each does what it means on the CPU: work is synchronous
(`synchronize` has nothing to wait for), there is one device, the generator is torch's default
one, there is no cache to empty, and memory is the process's resident set, whose peak Linux
resets on request (see [Note: the CPU's peak memory]).
"""

from __future__ import annotations

import contextlib
import resource
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from shardwise.accelerator.base import BaseAccelerator

# [Note: the CPU's peak memory]
# "Memory allocated" on a CPU is the process's resident set (VmRSS in /proc/self/status) and its
# peak is VmHWM, which Linux resets to the current resident set when "5" is written to
# /proc/self/clear_refs: `reset_peak_memory_stats` does that, so a script's "peak since the
# reset" reads as it does on CUDA. Where /proc is missing, the peak is getrusage's ru_maxrss
# since the process started (which cannot be reset) and the current value falls back to it.
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def _peak_since_start_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


class CpuAccelerator(BaseAccelerator):
    """The host CPU; collectives over gloo."""

    support_set_device: bool = False

    def __init__(self) -> None:
        super().__init__(name="cpu", communication_backend="gloo", is_synchronous=True)

    def get_version(self) -> str:
        return ""

    def get_current_device(self) -> torch.device:
        return torch.device("cpu")

    def current_device(self) -> int:
        return 0

    def set_device(self, device: torch.device | int | None = None) -> None:
        """Nothing to bind: a process computes on the host CPU."""
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"the CPU accelerator has no device {device!r}; leave it None")

    def get_device_name(self, device: torch.device | int | None = None) -> str:
        return "cpu"

    def synchronize(self, device: torch.device | int | None = None) -> None:
        """CPU work is done when its call returns: nothing to wait for."""

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def empty_cache(self) -> None:
        """The CPU allocator keeps no cache to empty."""

    def memory_allocated(self, device: Any = None) -> int:
        current = _status_bytes("VmRSS")
        return current if current is not None else _peak_since_start_bytes()

    def max_memory_allocated(self, device: Any = None) -> int:
        peak = _status_bytes("VmHWM")
        return peak if peak is not None else _peak_since_start_bytes()

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        """Start the peak from the current resident set (see [Note: the CPU's peak
        memory])."""
        with contextlib.suppress(OSError):  # no /proc: the peak stays the process's
            _CLEAR_REFS.write_text("5")

    def memory_reserved(self, device: Any = None) -> int:
        return self.memory_allocated(device)

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.max_memory_allocated(device)

    def autocast(
        self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True
    ) -> AbstractContextManager[Any]:
        return torch.autocast("cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
