"""How much non-model memory a step holds at each module boundary.

On CUDA the allocator knows: allocated bytes less the model state the manager accounts. A host
allocator keeps no such count, so on the CPU the tracer counts what dominates non-model memory
in training, the activations autograd saves for backward: every saved tensor that is not a
parameter (or a view of one) is counted once per storage from when forward saves it until
backward drops it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks


class _Saved:
    """A saved activation; counted as live until autograd drops it."""

    __slots__ = ("__weakref__", "_release", "tensor")

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None] | None) -> None:
        self.tensor = tensor
        self._release = release

    def __del__(self) -> None:
        if self._release is not None:
            self._release()


class MemoryTracer:
    """Samples non-model bytes on `device` (see the module note for what is counted where).

    Args:
        device: the compute device.
        model_bytes: returns the model-state bytes the manager accounts on the device (CUDA only
            subtracts them from the allocator's count).
    """

    def __init__(self, device: torch.device, model_bytes: Callable[[], int]) -> None:
        self.device = device
        self._model_bytes = model_bytes
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self._hooks: saved_tensors_hooks | None = None

    def start(self) -> None:
        """Begin counting saved activations (a no-op on CUDA, whose allocator counts)."""
        if self.device.type != "cuda" and self._hooks is None:
            self._hooks = saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()

    def stop(self) -> None:
        """Stop counting newly saved tensors; those already saved are tracked until dropped."""
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def sample(self) -> int:
        if self.device.type == "cuda":
            return max(0, torch.cuda.memory_allocated(self.device) - self._model_bytes())
        return sum(entry[0] for entry in self._live.values())

    def _pack(self, tensor: torch.Tensor) -> Any:
        base = tensor._base if tensor._base is not None else tensor
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return _Saved(tensor, None)
        key = tensor.untyped_storage().data_ptr()
        entry = self._live.setdefault(key, [tensor.untyped_storage().nbytes(), 0])
        entry[1] += 1

        def release() -> None:
            live = self._live.get(key)
            if live is not None:
                live[1] -= 1
                if live[1] == 0:
                    del self._live[key]

        return _Saved(tensor, release)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        tensor: torch.Tensor = saved.tensor
        return tensor
