"""How a lazily built tensor gets its values: the call that created its storage and the writes
made to it since, recorded by `recorder.Recorder` and replayed here one module at a time.

[Note: lazy recipes]
Under `LazyInitContext` every tensor the model's code creates lives on the meta device (shapes,
no storage), and each new meta storage gets a `Root`: the `Call` that created it (a factory
such as `torch.empty`, or an op over other lazy tensors such as `1.0 / base ** arange`), and
the in-place `Write`s made to any view of it since (`nn.init.kaiming_uniform_`, `zero_`,
`copy_`, ...), each with the view's geometry. A lazy tensor handed to a later call is a `Ref`:
its root, how many writes the root had then (its version), and its geometry. Roots are found
from a meta tensor through its storage, which every view, `.data` and `nn.Parameter` of it
shares.

Replaying a root runs its call on the device the eager code would have used, then its writes
in order, skipping those a later write overwrites whole (kaiming_uniform_ before a model's own
normal_); a write that drew random numbers runs from the generator state it was recorded with
(see [Note: the random stream] in recorder.py), and leaves the generator as it found it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map

# Writes that set every element of their target without reading it: an earlier write to the
# same whole root is dead once one of these follows it.
OVERWRITING = frozenset(
    {
        "copy_",
        "fill_",
        "zero_",
        "normal_",
        "uniform_",
        "random_",
        "bernoulli_",
        "exponential_",
        "cauchy_",
        "log_normal_",
        "geometric_",
        "constant_",
        "ones_",
        "zeros_",
        "eye_",
        "dirac_",
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "trunc_normal_",
        "orthogonal_",
        "sparse_",
        "load_pretrained_",
    }
)

Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # (size, stride, storage offset)


def geometry_of(tensor: torch.Tensor) -> Geometry:
    return tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset())


@dataclass(frozen=True, slots=True)
class RandomState:
    """A generator and its state just before a recorded random op."""

    generator: torch.Generator
    state: torch.Tensor


@dataclass(frozen=True, slots=True)
class Call:
    """A recorded call; lazy tensors in `args` / `kwargs` are `Ref`s, and `TARGET` marks the
    tensor a write goes to. Runs under the default dtype it was recorded with, whose value
    decides what factories and type promotion give."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    default_dtype: torch.dtype
    random: RandomState | None = None

    @property
    def name(self) -> str:
        return getattr(self.func, "__name__", "")


class _Target:
    def __repr__(self) -> str:
        return "TARGET"


TARGET = _Target()


@dataclass(eq=False, slots=True)
class Write:
    """An in-place call on the view `geometry` of a root."""

    geometry: Geometry
    call: Call


@dataclass(eq=False, slots=True)
class Root:
    """One lazily created storage: how it was created (`call`, and `pick` into its result for
    ops with several outputs), on which `device`, with which `geometry` and `dtype`, and the
    writes made to it since."""

    call: Call
    device: torch.device
    geometry: Geometry
    dtype: torch.dtype
    pick: tuple[int, ...] = ()
    writes: list[Write] = field(default_factory=list)

    def covers(self, geometry: Geometry) -> bool:
        return geometry == self.geometry and self.geometry[2] == 0


@dataclass(frozen=True, slots=True)
class Ref:
    """A lazy tensor as some call saw it: `root` after its first `version` writes, through
    the view `geometry`."""

    root: Root
    version: int
    geometry: Geometry


class Replay:
    """Computes lazy tensors' values; what one replay computed it reuses (a root at a
    version, a call with several outputs), so make one per module and drop it after."""

    def __init__(self) -> None:
        self._roots: dict[tuple[int, int], torch.Tensor] = {}
        self._calls: dict[int, Any] = {}

    def value(self, ref: Ref) -> torch.Tensor:
        size, stride, offset = ref.geometry
        return self._root(ref.root, ref.version).as_strided(size, stride, offset)

    def _root(self, root: Root, version: int) -> torch.Tensor:
        key = (id(root), version)
        if key in self._roots:
            return self._roots[key]
        writes = root.writes[:version]
        # See [Note: lazy recipes]: what comes before the last whole overwrite is dead.
        last_overwrite = None
        for index, write in enumerate(writes):
            if write.call.name in OVERWRITING and root.covers(write.geometry):
                last_overwrite = index
        with torch.no_grad():
            if last_overwrite is None:
                base = self._create(root)
                if writes:  # the call's result may be another version's, or another root's
                    base = base.clone()
            else:
                size, stride, _ = root.geometry
                base = torch.empty_strided(size, stride, dtype=root.dtype, device=root.device)
            for write in writes[last_overwrite or 0 :]:
                target = base.as_strided(*write.geometry)
                self._run(write.call, target)
        self._roots[key] = base
        return base

    def _create(self, root: Root) -> torch.Tensor:
        key = id(root.call)
        if key not in self._calls:
            self._calls[key] = self._run(root.call, None)
        result = self._calls[key]
        for index in root.pick:
            result = result[index]
        if not isinstance(result, torch.Tensor):
            raise TypeError(f"{root.call.name} gave {type(result).__name__}, not a tensor")
        return result.detach()

    def _run(self, call: Call, target: torch.Tensor | None) -> Any:
        def resolve(item: Any) -> Any:
            if item is TARGET:
                return target
            if isinstance(item, Ref):
                return self.value(item)
            return item

        args = tree_map(resolve, call.args)
        kwargs = tree_map(resolve, call.kwargs)
        with _default_dtype(call.default_dtype), _random_state(call.random):
            return call.func(*args, **kwargs)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@contextmanager
def _random_state(random: RandomState | None) -> Iterator[None]:
    if random is None:
        yield
        return
    saved = random.generator.get_state()
    random.generator.set_state(random.state)
    try:
        yield
    finally:
        random.generator.set_state(saved)


# ---- finding a meta tensor's root ------------------------------------------------------------

# Storage (its address) -> root. Each entry holds a meta tensor of that storage (`_PINS`), so
# the address cannot be reused while the entry lives; `forget_unused` drops entries no other
# tensor shares any more.
_ROOTS: dict[int, Root] = {}
_PINS: dict[int, torch.Tensor] = {}


def _storage_key(tensor: torch.Tensor) -> int:
    key: int = tensor.untyped_storage()._cdata
    return key


def register(tensor: torch.Tensor, root: Root) -> None:
    key = _storage_key(tensor)
    _ROOTS[key] = root
    _PINS[key] = tensor.detach()


def root_of(tensor: torch.Tensor) -> Root | None:
    """The root of a lazily built tensor, or None (a tensor with storage, or a meta tensor
    made outside `LazyInitContext`)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
        return None
    return _ROOTS.get(_storage_key(tensor))


def ref_to(tensor: torch.Tensor) -> Ref | None:
    """`tensor` as it is now, or None when it is not lazy."""
    root = root_of(tensor)
    if root is None:
        return None
    return Ref(root, len(root.writes), geometry_of(tensor))


def _lone_use_count() -> int:
    # A storage's use count with one tensor on it, once its Python object exists (as `_PINS`'
    # have): that object, kept alive with the storage, counts too.
    pin = torch.empty(1, device="meta")
    key = _storage_key(pin)
    count: int = torch._C._storage_Use_Count(key)
    return count


_LONE = _lone_use_count()


def forget_unused() -> None:
    """Drop the roots whose storage only their pin still uses (every tensor of it is gone or
    was materialised); refs held by other recipes keep theirs alive."""
    for key in [k for k in _ROOTS if torch._C._storage_Use_Count(k) <= _LONE]:
        del _ROOTS[key], _PINS[key]
