"""What the planner needs of a model: its parameter sizes, in packing order when known."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the planner needs of a model: its parameter sizes, in packing order when known."""

    num_params: int
    largest_tensor_numel: int
    tensor_numels: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_params < 1 or self.largest_tensor_numel < 1:
            raise ValueError(
                f"num_params and largest_tensor_numel must be >= 1, got {self.num_params} and "
                f"{self.largest_tensor_numel}"
            )
        if self.largest_tensor_numel > self.num_params:
            raise ValueError(
                f"largest_tensor_numel ({self.largest_tensor_numel}) exceeds num_params "
                f"({self.num_params})"
            )

    @classmethod
    def from_module(cls, module: nn.Module) -> ModelSpec:
        """Trainable parameters of `module`, each once (build it on the meta device to plan
        without allocating it)."""
        numels = tuple(p.numel() for p in dict.fromkeys(module.parameters()) if p.requires_grad)
        if not numels:
            raise ValueError("the module has no trainable parameters")
        return cls(num_params=sum(numels), largest_tensor_numel=max(numels), tensor_numels=numels)
