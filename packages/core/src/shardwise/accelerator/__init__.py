"""`colossalai.accelerator`'s path: the device a process computes on, behind one object
(`get_accelerator()`), CUDA or the CPU."""

from shardwise.accelerator.api import auto_set_accelerator, get_accelerator, set_accelerator
from shardwise.accelerator.base import BaseAccelerator
from shardwise.accelerator.cpu import CpuAccelerator
from shardwise.accelerator.cuda import CudaAccelerator

__all__ = [
    "BaseAccelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "auto_set_accelerator",
    "get_accelerator",
    "set_accelerator",
]
