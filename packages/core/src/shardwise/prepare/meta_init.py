"""Models built on the meta device, materialised one module at a time as they are packed.

[Note: meta-device models]
A model built under `torch.device("meta")` has shapes and no storage, so a model larger than
one rank's memory can be described everywhere. The engine packs parameters into chunks in
`named_parameters()` order and shards each chunk as soon as it is full (see [Note: packing one
chunk at a time] in chunk/manager.py); just before a parameter is packed, the module that owns
it gets real, empty storage for its own parameters and buffers, in place (the same tensor
objects, so tied weights stay tied and references held elsewhere stay valid), and is
initialised by the user's `param_init_fn(module)` or else by its own `reset_parameters()`.
Only the module being packed and the open chunk are ever whole on a rank. Every rank runs the
same initialisation from the same random state, and a chunk takes rank 0's values anyway.
Modules initialise in `modules()` order, which is the order their constructors ran for the
usual models, so with the same seed the values equal an unsharded construction wherever
`reset_parameters` defines them. An initialiser must touch only the module's own tensors
(`recurse=False`), as torch's `reset_parameters` do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

ParamInitFn = Callable[[nn.Module], None]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module, recurse=True))


class MetaMaterializer:
    """Gives the modules of a meta-device model storage on `device` and initial values.

    Args:
        module: the model, some of whose parameters or buffers are on the meta device.
        device: where the materialised tensors go.
        param_init_fn: initialises one module's own parameters and buffers; None calls the
            module's `reset_parameters()`.
    """

    def __init__(
        self, module: nn.Module, device: torch.device, param_init_fn: ParamInitFn | None
    ) -> None:
        self._root = module
        self._device = device
        self._init = param_init_fn
        self._owner: dict[int, nn.Module] = {}
        for submodule in module.modules():
            for param in submodule.parameters(recurse=False):
                self._owner.setdefault(id(param), submodule)
            # Refused at wrap time, not when its parameters are first packed (stages 1-2 pack
            # once the optimizer is wrapped).
            on_meta = any(t.is_meta for t in _tensors(submodule, recurse=False))
            resets = callable(getattr(submodule, "reset_parameters", None))
            if param_init_fn is None and on_meta and not resets:
                raise ValueError(_NO_INITIALISER.format(type(submodule).__name__))

    def before_packing(self, param: nn.Parameter) -> None:
        """Materialise the module that owns `param` if it is still on the meta device."""
        if param.is_meta:
            self._materialise(self._owner[id(param)])

    def finish(self) -> None:
        """Materialise what packing did not reach (modules with meta buffers only)."""
        for submodule in self._root.modules():
            if any(t.is_meta for t in _tensors(submodule, recurse=False)):
                self._materialise(submodule)

    def _materialise(self, module: nn.Module) -> None:
        for tensor in _tensors(module, recurse=False):
            if tensor.is_meta:
                empty = torch.empty_like(tensor, device=self._device)
                if isinstance(tensor, nn.Parameter):
                    empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
                torch.utils.swap_tensors(tensor, empty)
        with torch.no_grad():
            if self._init is not None:
                self._init(module)
            elif callable(reset := getattr(module, "reset_parameters", None)):
                reset()
            else:
                raise ValueError(_NO_INITIALISER.format(type(module).__name__))
        left = [name for name, t in _named_tensors(module) if t.is_meta]
        if left:
            raise ValueError(
                f"the initialiser of {type(module).__name__} left {left} on the meta device: "
                f"it must initialise the module's tensors in place, not replace them"
            )


_NO_INITIALISER = (
    "{} was built on the meta device and has no reset_parameters() to initialise its tensors: "
    "pass param_init_fn=fn in gemini_config, where fn(module) initialises one module's own "
    "parameters and buffers (recurse=False)"
)


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def _tensors(module: nn.Module, *, recurse: bool) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)
