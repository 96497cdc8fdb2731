"""What a parameter in a chunk looks like from outside: its own shape always, its values only
inside the forward and backward of the modules that use it.

[Note: parameters keep their shape]
A sharded parameter holds no elements (its chunk keeps only this rank's shard), yet code
written for unsharded models reads parameters' shapes after wrapping: nanoGPT's
`configure_optimizers` puts `p.dim() >= 2` in the weight-decay group, Lightning calls
`configure_optimizers` after the strategy sharded the model, summaries count `p.numel()`. So a
chunk's parameters report the shape they were built with (`shape`, `size()`, `dim()`, `ndim`,
`numel()`, `len()`), as FSDP2's DTensor parameters do, at no memory cost. Any other use of a
sharded one raises at once, naming the parameter, instead of computing with an empty tensor (a
reduction would silently give 0): `ShardedParameter.__torch_function__` lets only attribute
access and the metadata calls listed in `_METADATA_CALLS` through. At stages 1-2 with deferred
parameter gathers, a `PendingParameter` waits for its chunk's gather before any read of its
values.

[Note: two faces of a stage-3 parameter]
At stage 3 each parameter of a sharded chunk has two tensors, each with a class, shape and
storage that never change: the *sharded face*, the parameter object the model was built with
(optimizers, state dicts and user code outside forward hold it; a `ShardedParameter`, holding
no element), and the *compute face*, a plain `nn.Parameter` viewing its place in the chunk's
compute buffer, whose storage the chunk frees on release and refills on gather (the trick
torch's FSDP uses: views autograd saved in forward see the re-gathered data in backward). The
module's registration points at the compute face only while the gather unit that governs the
parameter runs (its forward, and a forward re-run in backward), and at the sharded face
otherwise (see [Note: gather units] in runtime/unit_plan.py), so code compiled with
`torch.compile` sees the same plain parameter, with the same metadata, on every call, and
never a tensor changing class or data behind its guards. Gradients accumulate on the compute
face. FSDP2 does the same with its sharded DTensor and unsharded parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

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


class ShardedParameter(ChunkParameter):
    """The sharded face of a stage-3 parameter: its shape reads as built, its values cannot
    be used (see [Note: two faces of a stage-3 parameter]). While a model learns its gather
    units (its first forward), a use of one reaches `_on_use`, which returns the compute face
    to use instead (see [Note: gather units] in runtime/unit_plan.py)."""

    _chunk_name: str
    _on_use: Any  # None, or a callable taking the parameter and returning its compute face

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name not in _METADATA_CALLS:
            flat = tree_flatten((args, kwargs))[0]
            sharded = [a for a in flat if isinstance(a, ShardedParameter)]
            if sharded and all(p._on_use is not None for p in sharded):
                faces = {id(p): p._on_use(p) for p in sharded}
                args, kwargs = tree_map(lambda a: faces.get(id(a), a), (args, kwargs))
                return func(*args, **kwargs)
            what = (
                f"{sharded[0]._chunk_name} (shape {tuple(sharded[0]._logical_shape)})"
                if sharded
                else "a sharded parameter"
            )
            raise RuntimeError(
                f"{name}() on {what}, whose chunk is released: stage 3 keeps only this rank's "
                f"shard between uses. Its values exist inside the forward and backward of the "
                f"gather unit that uses it; to read them whole, use model.state_dict() (a "
                f"collective)"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardedParameter(shape={tuple(self._logical_shape)}, dtype={self.dtype})"


class PendingParameter(ChunkParameter):
    """A chunk parameter whose new values are still being all-gathered after a stage-1/2 step
    (see [Note: deferred parameter gathers] in runtime/param_gather.py): any use of its values
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


def shard_face(param: nn.Parameter, name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Make chunk parameter `param` the sharded face of `name` (once, when its chunk is first
    sharded): it holds no element from now on, and reports `dtype` and `device`, the compute
    face's."""
    param.data = torch.empty(0, dtype=dtype, device=device)
    param._chunk_name = name  # type: ignore[attr-defined]
    param._on_use = None  # type: ignore[attr-defined]
    param.__class__ = ShardedParameter


def whole_face(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make sharded face `param` a plain parameter holding `value`, its whole values, while the
    module rests between runs (see [Note: a module at rest] in engine/module_at_rest.py);
    `empty_face` makes it the sharded face again. Its attributes (name, `_on_use`) are kept."""
    param.__class__ = nn.Parameter
    param.data = value


def empty_face(param: nn.Parameter, dtype: torch.dtype, device: torch.device) -> None:
    """Make `param`, given its whole values by `whole_face`, the sharded face again: no
    element, reporting `dtype` and `device` (the compute face's), with the hook it had."""
    param.data = torch.empty(0, dtype=dtype, device=device)
    param.__class__ = ShardedParameter


def on_use(param: nn.Parameter, hook: Callable[[nn.Parameter], nn.Parameter] | None) -> None:
    """Have a use of sharded face `param` call `hook`, which returns the tensor to use instead
    (None: a use raises)."""
    param._on_use = hook  # type: ignore[attr-defined]


def compute_face(view: torch.Tensor, param: nn.Parameter) -> nn.Parameter:
    """The compute face of `param`: a plain parameter over `view` of the chunk's buffer."""
    face = nn.Parameter(view.new_empty(0), requires_grad=param.requires_grad)
    # Assigned through `.data`, the face keeps a version counter of its own: gathers write the
    # buffer, and tensors autograd saved from the face must not read as modified by them.
    face.data = view
    return face
