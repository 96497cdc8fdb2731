"""OptimizerWrapper: a boosted optimizer around a torch optimizer (ColossalAI's
`colossalai.interface.OptimizerWrapper`), with the methods a ColossalAI training loop calls."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class OptimizerWrapper:
    """`optim` seen through ColossalAI's optimizer interface: `backward(loss)`, `step()`,
    `zero_grad()`, clipping, `param_groups`, `unwrap()`."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"optim must be a torch.optim.Optimizer, got {type(optim).__name__}")
        self.optim = optim

    @property
    def parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optim.param_groups for p in group["params"]]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    def add_param_group(self, *args: Any, **kwargs: Any) -> Any:
        return self.optim.add_param_group(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self.optim.zero_grad(*args, **kwargs)

    def backward(
        self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False, **kwargs: Any
    ) -> None:
        loss.backward(inputs=inputs, retain_graph=retain_graph, **kwargs)

    def backward_by_grad(
        self,
        tensor: torch.Tensor,
        grad: torch.Tensor,
        inputs: Any = None,
        retain_graph: bool = False,
    ) -> None:
        torch.autograd.backward(
            tensors=tensor, grad_tensors=grad, inputs=inputs, retain_graph=retain_graph
        )

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.optim.load_state_dict(*args, **kwargs)

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        nn.utils.clip_grad_value_(self.parameters, clip_value, *args, **kwargs)

    def clip_grad_by_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Clip the gradients now (`torch.nn.utils.clip_grad_norm_`); returns their norm."""
        return nn.utils.clip_grad_norm_(
            self.parameters, max_norm, norm_type, error_if_nonfinite, *args, **kwargs
        )

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs: Any) -> float | None:
        raise NotImplementedError(
            f"{type(self).__name__} keeps no gradient norm: call clip_grad_by_norm, which "
            f"returns it"
        )

    def unwrap(self) -> torch.optim.Optimizer:
        """The torch optimizer inside."""
        return self.optim
