"""The module whose names a checkpoint holds."""

from __future__ import annotations

from torch import nn


def saved_module(module: nn.Module) -> nn.Module:
    """`module`, or the module `torch.compile` wrapped. `torch.compile(model)` returns a wrapper
    whose state dict puts `_orig_mod.` before every key: names that `from_pretrained`, and the
    same model run uncompiled, would not find. The wrapper's parameters and buffers are the
    wrapped module's own, so its state is the same tensors under the model's own names."""
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(module, OptimizedModule):
        inner = module._orig_mod
        assert isinstance(inner, nn.Module)
        module = inner
    return module
