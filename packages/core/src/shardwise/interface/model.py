"""ModelWrapper: a boosted model around the user's module (ColossalAI's
`colossalai.interface.ModelWrapper`)."""

from __future__ import annotations

from typing import Any

from torch import nn


class ModelWrapper(nn.Module):
    """A module around the user's `module`, calling it in `forward`; `unwrap()` returns the
    user's module through any number of wrappers."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def unwrap(self) -> nn.Module:
        # Each wrapper knows what it holds (a DDP inside TorchDDPPlugin's, say): ask it.
        inner = self.module
        return inner.unwrap() if isinstance(inner, ModelWrapper) else inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
