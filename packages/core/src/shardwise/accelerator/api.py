"""The process's accelerator: CUDA when torch sees a device, else the CPU, as ColossalAI's
`get_accelerator()` picks it (its NPU is not offered)."""

from __future__ import annotations

from shardwise.accelerator.base import BaseAccelerator
from shardwise.accelerator.cpu import CpuAccelerator
from shardwise.accelerator.cuda import CudaAccelerator

_KINDS: dict[str, type[CpuAccelerator] | type[CudaAccelerator]] = {
    "cuda": CudaAccelerator,
    "cpu": CpuAccelerator,
}
_current: list[BaseAccelerator] = []  # the process's one accelerator, once chosen


def set_accelerator(accelerator: str | BaseAccelerator) -> None:
    """Use `accelerator` ("cuda", "cpu", or an accelerator object) from now on.

    Args:
        accelerator: the kind's name or the object.
    """
    chosen: BaseAccelerator
    if isinstance(accelerator, str):
        if accelerator not in _KINDS:
            raise ValueError(f"accelerator must be one of {sorted(_KINDS)}, got {accelerator!r}")
        chosen = _KINDS[accelerator]()
    elif isinstance(accelerator, BaseAccelerator):
        chosen = accelerator
    else:
        raise TypeError(
            f"accelerator must be a name or a BaseAccelerator, got {type(accelerator).__name__}"
        )
    _current[:] = [chosen]


def auto_set_accelerator() -> None:
    """Use CUDA when it is available, else the CPU."""
    set_accelerator("cuda" if CudaAccelerator().is_available() else "cpu")


def get_accelerator() -> BaseAccelerator:
    """The accelerator of this process (chosen by `auto_set_accelerator` on first use)."""
    if not _current:
        auto_set_accelerator()
    return _current[0]
