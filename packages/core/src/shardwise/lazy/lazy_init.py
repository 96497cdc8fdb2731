"""`LazyInitContext`: ColossalAI's lazy construction (`colossalai.lazy.LazyInitContext`), on
the engine's meta-device initialisation.

[Note: lazily built models]
Inside the context a model is built on the meta device, costing no memory for its tensors,
while every op that created or initialised them is recorded (see [Note: lazy recipes] in
recipe.py). Its values come later, one module at a time: `booster.boost` hands the ZeRO engine
an initialiser (`initialiser_for`) that it calls as it packs each module into chunks, so only
the module being packed and the open chunk are ever whole on a rank (see [Note: meta-device
models] in prepare/meta_init.py); TorchDDPPlugin and `LazyInitContext.materialize` replay the
whole model in place. The values are those an eager build from the same random state gives,
bit for bit (see [Note: the random stream] in recorder.py), and the random stream after the
build is the eager build's too. `from_pretrained` inside the context reads each tensor from
the checkpoint files as its module is materialised instead (see lazy/pretrained.py).

Only parameters and buffers are materialised; a lazily built tensor kept elsewhere (a plain
attribute that is not also a buffer) stays on the meta device, as in ColossalAI.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import TracebackType
from typing import Any, ClassVar

import torch
from torch import nn

from shardwise.lazy import pretrained
from shardwise.lazy.recipe import Ref, Replay, forget_unused, ref_to
from shardwise.lazy.recorder import Recorder

_log = logging.getLogger(__name__)


class LazyInitContext:
    """Build a model without allocating its tensors; `booster.boost(model)` (any plugin) or
    `LazyInitContext.materialize(model)` gives them their values, which equal an eager build's
    from the same random state (see [Note: lazily built models]).

    ```python
    with LazyInitContext():
        model = LlamaForCausalLM(config)  # or AutoModelForCausalLM.from_pretrained(path)
    model, optimizer, *_ = booster.boost(model, optimizer)
    ```

    Args:
        tensor_cls: ColossalAI's test hook choosing its lazy tensor class; refused unless
            None (no tensor subclass is involved here).
        default_device: where tensors created without a device would have been, and are
            materialised (None: the CPU), as an eager build under `torch.device(...)`.
    """

    _active: ClassVar[bool] = False

    def __init__(self, tensor_cls: Any = None, default_device: Any = None) -> None:
        if tensor_cls is not None:
            raise ValueError(
                f"tensor_cls={tensor_cls!r} cannot be honoured: shardwise records the model's "
                f"ops without a tensor class of its own; leave tensor_cls unset"
            )
        self.default_device = _device(default_device)
        self._recorder: Recorder | None = None
        self._unpatch: pretrained.Unpatch | None = None

    def __enter__(self) -> LazyInitContext:
        if LazyInitContext._active:
            raise ValueError("LazyInitContext is not reentrant: leave the open one first")
        forget_unused()
        LazyInitContext._active = True
        self._recorder = Recorder(self.default_device)
        self._recorder.__enter__()
        self._unpatch = pretrained.patch_from_pretrained(self._recorder)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if self._unpatch is not None:
                self._unpatch()
            if self._recorder is not None:
                self._recorder.__exit__(exc_type, exc, traceback)
        finally:
            self._unpatch = self._recorder = None
            LazyInitContext._active = False

    @staticmethod
    def materialize(module: nn.Module, verbose: bool = False) -> nn.Module:
        """Give every lazily built parameter and buffer of `module` its values, in place (the
        same tensor objects, so tied weights stay tied and references stay valid), one
        module at a time; returns `module`.

        Args:
            module: a model built (wholly or partly) inside `LazyInitContext`.
            verbose: log how many tensors were lazy.
        """
        initialise = initialiser_for(module)
        if initialise is None:
            return module
        lazy, total = initialise.pending, _count_tensors(module)
        with torch.no_grad():
            for submodule in module.modules():
                initialise.swap_in(submodule)
        if verbose:
            _log.info("LazyInitContext.materialize: %d of %d tensors were lazy", lazy, total)
        forget_unused()
        return module


class LazyInitialiser:
    """Gives the lazily built tensors of one model their values, one module at a time: the
    engine's `param_init_fn` (called after it gave the module's meta tensors empty storage),
    or `swap_in` for a model used without the engine.

    Args:
        refs: id(tensor) -> what the tensor is, for every lazily built parameter and buffer.
    """

    def __init__(self, refs: dict[int, Ref]) -> None:
        self._refs = refs

    @property
    def pending(self) -> int:
        return len(self._refs)

    def __call__(self, module: nn.Module) -> None:
        _check_closed()
        replay = Replay()
        for tensor in _own_tensors(module):
            ref = self._refs.pop(id(tensor), None)
            if ref is not None:
                tensor.copy_(replay.value(ref))

    def swap_in(self, module: nn.Module) -> None:
        """Replace `module`'s own lazy tensors' storage with their values, in place."""
        _check_closed()
        replay = Replay()
        for tensor in _own_tensors(module):
            ref = self._refs.pop(id(tensor), None)
            if ref is None:
                continue
            value = replay.value(ref)
            if isinstance(tensor, nn.Parameter):
                value = nn.Parameter(value, requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, value)


def initialiser_for(module: nn.Module) -> LazyInitialiser | None:
    """The initialiser of `module`'s lazily built tensors, or None when it has none. A tensor
    on the meta device that was not built in `LazyInitContext` is refused: nothing knows its
    values."""
    refs: dict[int, Ref] = {}
    unknown: list[str] = []
    for name, tensor in _named_tensors(module):
        if not tensor.is_meta or id(tensor) in refs:
            continue
        ref = ref_to(tensor)
        if ref is None:
            unknown.append(name)
        else:
            refs[id(tensor)] = ref
    if refs and unknown:
        raise ValueError(
            f"{unknown[:5]} (and {max(len(unknown) - 5, 0)} more) are on the meta device but were "
            f"not built in LazyInitContext, so nothing knows their values: build them inside "
            f"the context too (with booster.enable_lora, call it inside the context)"
        )
    return LazyInitialiser(refs) if refs else None


def _check_closed() -> None:
    # Replayed inside the context, the values would be recorded again instead of computed.
    if LazyInitContext._active:
        raise ValueError(
            "a lazily built model is materialised (boost, materialize) inside LazyInitContext: "
            "leave the context first"
        )


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=False)
    yield from (b for b in module.buffers(recurse=False))


def _count_tensors(module: nn.Module) -> int:
    return sum(1 for _ in _named_tensors(module))


def _device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    if isinstance(device, (str, torch.device)):
        resolved = torch.device(device)
        if resolved.type == "meta":
            raise ValueError(
                "default_device='meta' cannot be honoured: the context already builds on the "
                "meta device; default_device is where the values are materialised"
            )
        return resolved
    raise TypeError(
        f"default_device must be a torch.device, a device string or a CUDA index, got "
        f"{type(device).__name__}"
    )
