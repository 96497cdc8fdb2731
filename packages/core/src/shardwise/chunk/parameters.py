"""What a parameter in a chunk looks like from outside: its own shape always, its values only
while its chunk is gathered.

[Note: parameters keep their shape]
A released parameter holds no elements (its chunk keeps only this rank's shard), yet code
written for unsharded models reads parameters' shapes after wrapping: nanoGPT's
`configure_optimizers` puts `p.dim() >= 2` in the weight-decay group, Lightning calls
`configure_optimizers` after the strategy sharded the model, summaries count `p.numel()`. So a
chunk's parameters report the shape they were built with (`shape`, `size()`, `dim()`, `ndim`,
`numel()`, `len()`), as FSDP2's DTensor parameters do, at no memory cost. While released, any
other use of one raises at once, naming the parameter, instead of computing with an empty
tensor (a reduction would silently give 0): `ReleasedParameter.__torch_function__` lets only
attribute access and the metadata calls listed in `_METADATA_CALLS` through. Both classes are
subclasses of `nn.Parameter`; a parameter's class changes in place, so it stays the same
object that optimizers and modules hold. At stages 1-2 with deferred parameter gathers, a
`PendingParameter` waits for its chunk's gather before any read of its values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

# Calls that read no element: attribute access on a Tensor goes through `__get__`/`__set__`.
# `detach` (torch's Module.state_dict, which code calls for the names) gives the empty tensor
# the parameter holds, as before; `module.to(...)` and the like convert that empty tensor (a
# no-op for its values); copying or pickling a module copies it as it stands.
_METADATA_CALLS = frozenset(
    {
        "detach",
        "_has_compatible_shallow_copy_type",
        "to",
        "cpu",
        "cuda",
        "__deepcopy__",
        "__reduce_ex__",
        "__setstate__",
        "__get__",
        "__set__",
        "__hash__",
        "__format__",
        "numel",
        "dim",
        "size",
        "data_ptr",
        "element_size",
        "is_floating_point",
        "is_complex",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "requires_grad_",
        "untyped_storage",
    }
)


class ChunkParameter(nn.Parameter):
    """A parameter whose values live in a chunk; its shape is the one it was built with."""

    _logical_shape: torch.Size

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return self._logical_shape

    @property
    def ndim(self) -> int:  # type: ignore[override]
        return len(self._logical_shape)

    def size(self, dim: int | None = None) -> Any:
        return self._logical_shape if dim is None else self._logical_shape[dim]

    def dim(self) -> int:
        return len(self._logical_shape)

    def numel(self) -> int:
        return self._logical_shape.numel()

    def __deepcopy__(self, memo: dict[int, Any]) -> ChunkParameter:
        # nn.Parameter's copy keeps the class but not the attributes that give the shape.
        result = super().__deepcopy__(memo)
        for name in ("_logical_shape", "_chunk_name"):
            if name in self.__dict__:
                setattr(result, name, self.__dict__[name])
        return result  # type: ignore[no-any-return]

    def __len__(self) -> int:
        if not self._logical_shape:
            raise TypeError("len() of a 0-d tensor")
        return self._logical_shape[0]


class ReleasedParameter(ChunkParameter):
    """A chunk parameter whose chunk is released: its shape reads as built, its values cannot
    be used (see [Note: parameters keep their shape])."""

    _chunk_name: str

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name not in _METADATA_CALLS:
            released = next((a for a in args if isinstance(a, ReleasedParameter)), None)
            what = (
                f"{released._chunk_name} (shape {tuple(released._logical_shape)})"
                if released is not None
                else "a released parameter"
            )
            raise RuntimeError(
                f"{name}() on {what}, whose chunk is released: stage 3 keeps only this rank's "
                f"shard between uses. Its values exist inside the forward and backward of the "
                f"module that owns it; to read them whole, use model.state_dict() (a collective)"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ReleasedParameter(shape={tuple(self._logical_shape)}, dtype={self.dtype})"


class PendingParameter(ChunkParameter):
    """A chunk parameter whose new values are still being all-gathered after a stage-1/2 step
    (see [Note: deferred parameter gathers] in zero/param_gather.py): any use of its values
    first waits for that gather, so nothing reads a half-updated parameter."""

    _wait_for_values: Any  # the chunk's wait_publish

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if _reads_values(func):
            # Nested too: torch.stack([p, q]), torch._foreach_mul_(params, ...).
            for arg in tree_flatten((args, kwargs or {}))[0]:
                if isinstance(arg, PendingParameter):
                    arg._wait_for_values()  # turns every parameter of its chunk back
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __deepcopy__(self, memo: dict[int, Any]) -> ChunkParameter:
        # A copy (an EMA model, a teacher) takes the new values, and is a plain chunk parameter.
        self._wait_for_values()
        mark_settled(self)  # already, unless nothing was pending any more
        return self.__deepcopy__(memo)  # now ChunkParameter's


# Attributes whose reading reads no element of the parameter (`.data` hands out the values
# themselves; `.grad` is a tensor of its own).
_METADATA_ATTRIBUTES = frozenset(
    {"shape", "dtype", "device", "requires_grad", "is_leaf", "layout", "ndim", "names", "grad"}
)
# Calls that hand out the values or their memory, though they read no element themselves.
_VALUE_CALLS = frozenset({"to", "cpu", "cuda", "detach", "data_ptr", "untyped_storage"})


def _reads_values(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        return attribute not in _METADATA_ATTRIBUTES
    return name not in _METADATA_CALLS or name in _VALUE_CALLS


def mark_pending(param: nn.Parameter, wait: Any) -> None:
    """`param`'s chunk is being all-gathered in the background; `wait()` finishes it."""
    param._wait_for_values = wait  # type: ignore[attr-defined]
    param.__class__ = PendingParameter


def mark_settled(param: nn.Parameter) -> None:
    if isinstance(param, PendingParameter):
        param.__class__ = ChunkParameter  # type: ignore[assignment]


def adopt(param: nn.Parameter, shape: torch.Size) -> None:
    """Make `param` a chunk parameter reporting `shape` (once, when it is packed)."""
    param._logical_shape = torch.Size(shape)  # type: ignore[attr-defined]
    param.__class__ = ChunkParameter


def mark_gathered(param: nn.Parameter) -> None:
    if isinstance(param, ReleasedParameter):
        param.__class__ = ChunkParameter  # type: ignore[assignment]


def mark_released(param: nn.Parameter, name: str) -> None:
    param._chunk_name = name  # type: ignore[attr-defined]
    param.__class__ = ReleasedParameter
