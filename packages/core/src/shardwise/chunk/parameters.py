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
object that optimizers and modules hold.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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
