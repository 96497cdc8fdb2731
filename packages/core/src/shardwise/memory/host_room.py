"""How much host memory is left, checked before the engine takes more of it.

[Note: the host's room]
A model larger than its device keeps the rest of its state in host memory, and "auto" sends
more there when a step needs the device's room (activations larger than planned). Past what
the host has, the kernel's out-of-memory killer ends the process: every rank's work is lost,
with no word of why. So before the engine allocates a host buffer for a device it asks the
kernel what is left (`MemAvailable` in /proc/meminfo: free memory and what the page cache can
give back) and, where the buffer would leave less than `reserve_bytes`, raises
`HostMemoryExhausted` instead, saying how much the host lacks and what to do: keep
activations smaller (activation checkpointing), move optimizer state to the disk tier
(`nvme_offload_fraction`, or `host_budget_bytes`), or use more devices. The check reads one
small file per new host buffer; the pools of memory/ reuse buffers, so that is a few reads per
step at most. Where the kernel says nothing (not Linux), nothing is checked.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# Left to the rest of the process and the system: what a host buffer may not take.
DEFAULT_RESERVE_BYTES = 2 << 30
MEMINFO = Path("/proc/meminfo")


class HostMemoryExhausted(MemoryError):
    """A host buffer the engine needs would leave the host with less than its reserve."""


def available_host_bytes(meminfo: Path = MEMINFO) -> int | None:
    """The kernel's `MemAvailable`, in bytes; None where it does not say."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    return None


class HostRoom:
    """Refuses host buffers the host has no room for (see [Note: the host's room]).

    Args:
        reserve_bytes: what a buffer must leave available.
        available: reads what is available now (None: unknown, nothing is refused).
    """

    def __init__(
        self,
        reserve_bytes: int = DEFAULT_RESERVE_BYTES,
        available: Callable[[], int | None] = available_host_bytes,
    ) -> None:
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        self.reserve_bytes = reserve_bytes
        self._available = available

    def check(self, nbytes: int) -> None:
        """Raise `HostMemoryExhausted` if `nbytes` more would leave less than the reserve."""
        available = self._available()
        if available is None or available - nbytes >= self.reserve_bytes:
            return
        lacking = nbytes + self.reserve_bytes - available
        raise HostMemoryExhausted(
            f"the engine needs {nbytes / 2**30:.2f} GiB more host memory for the model state it "
            f"keeps there, but the host has {available / 2**30:.2f} GiB available and keeps "
            f"{self.reserve_bytes / 2**30:.2f} GiB for everything else: {lacking / 2**30:.2f} "
            f"GiB short. Make the step's activations smaller (activation checkpointing, a "
            f"smaller micro-batch), send optimizer state to the disk tier "
            f"(gemini_config['nvme_offload_fraction'] or 'host_budget_bytes'), or spread the "
            f"model over more devices"
        )


__all__ = [
    "DEFAULT_RESERVE_BYTES",
    "HostMemoryExhausted",
    "HostRoom",
    "available_host_bytes",
]
