"""The torch function mode under which a model is built lazily: every tensor its code creates
goes to the meta device, and what made it and what was written to it is recorded (see [Note:
lazy recipes] in recipe.py).

[Note: the random stream]
An eager build draws each random initialisation from the global generator in turn, so its
values depend on every draw before them. A lazy build replays its modules later, one at a
time, in another order. So each random op is recorded with the generator's state just before
it, and run once on a scratch tensor of its target's shape, strides and dtype, on the device
the eager build would use, to move the generator on exactly as the eager op would: the next
op's recorded state, and whatever the program draws after the build, are then the eager
build's. The scratch tensor is dropped at once (one tensor's memory, never the model's); the
price is running the random initialisations twice, once here and once when replayed. A random
op reading lazily built tensors (a mean, a probability) has them computed for its scratch run.
Random ops are known by name (`RANDOM`); an op outside that list that draws random numbers
inside one call would leave the stream behind the eager build's.

The legacy constructors (`torch.Tensor(3, 4)`, `torch.FloatTensor(...)`) are no torch
functions and are not seen: what they make has storage, as in an eager build, and stays so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from shardwise.lazy.recipe import (
    TARGET,
    Call,
    RandomState,
    Ref,
    Replay,
    Root,
    Write,
    geometry_of,
    ref_to,
    register,
    root_of,
)

_FACTORIES = {
    getattr(torch, name)
    for name in (
        "empty",
        "empty_strided",
        "zeros",
        "ones",
        "full",
        "rand",
        "randn",
        "randint",
        "randperm",
        "normal",
        "arange",
        "range",
        "linspace",
        "logspace",
        "eye",
        "tensor",
        "as_tensor",
        "scalar_tensor",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
    )
}
# Factories whose first argument is a tensor giving the shape, dtype and default device.
_LIKE = {f for f in _FACTORIES if f.__name__.endswith("_like")} | {
    getattr(torch.Tensor, name)
    for name in (
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
        "new_tensor",
    )
}
RANDOM = frozenset(
    {
        "normal_",
        "uniform_",
        "trunc_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "orthogonal_",
        "sparse_",
        "lecun_normal_",
        "default_flax_embed_init_",
        "bernoulli_",
        "random_",
        "exponential_",
        "cauchy_",
        "log_normal_",
        "geometric_",
        "rand",
        "randn",
        "randint",
        "randperm",
        "normal",
        "bernoulli",
        "multinomial",
        "poisson",
        "binomial",
        "rand_like",
        "randn_like",
        "randint_like",
        "dropout",
        "dropout_",
        "alpha_dropout",
        "feature_alpha_dropout",
        "rrelu",
        "rrelu_",
    }
)
# In-place methods that change a tensor's metadata, not its values: run as they are (a view's
# geometry is read when it is materialised).
_METADATA_IN_PLACE = frozenset(
    {
        "requires_grad_",
        "retain_grad",
        "as_strided_",
        "squeeze_",
        "unsqueeze_",
        "t_",
        "transpose_",
        "swapdims_",
        "swapaxes_",
        "detach_",
        "rename_",
        "share_memory_",
    }
)
_DUNDER_IN_PLACE = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
    }
)
_MOVES = frozenset({"to", "cuda", "cpu"})
_DEVICE_GETTER = torch.Tensor.device.__get__  # type: ignore[attr-defined]


class Recorder(TorchFunctionMode):
    """Builds tensors on the meta device and records their recipes.

    Args:
        device: where a tensor created without an explicit device would have been (and is
            materialised).
        exact_random: keep the random stream as an eager build's (see [Note: the random
            stream]); without it, random initialisations draw when they are replayed.
    """

    def __init__(self, device: torch.device, *, exact_random: bool = True) -> None:
        super().__init__()
        self.device = device
        self.exact_random = exact_random

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func == _DEVICE_GETTER:
            # A lazy tensor reports the device it will live on, so that code placing new
            # tensors beside it (`torch.arange(n, device=w.device)`) places them there.
            root = root_of(args[0])
            return root.device if root is not None else func(*args)
        # `torch.normal(mean_tensor, ...)` is an op over its tensor, not a factory.
        tensor_normal = func is torch.normal and bool(args) and isinstance(args[0], torch.Tensor)
        if (func in _FACTORIES and not tensor_normal) or func in _LIKE:
            return self._create(func, args, kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        lazy = [t for t in leaves if isinstance(t, torch.Tensor) and root_of(t) is not None]
        if not lazy:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):  # attributes (`.data`, `.grad`): as they are
            return func(*args, **kwargs)
        target = _write_target(name, args, kwargs)
        if target is not None:
            return self._write(func, name, target, args, kwargs)
        if name in _MOVES:
            return self._move(func, name, args, kwargs)
        root = root_of(lazy[0])
        assert root is not None
        return self._derive(func, name, args, kwargs, root.device)

    # ---- new storage ------------------------------------------------------------------------

    def _create(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        like = args[0] if func in _LIKE else None
        like_root = root_of(like) if isinstance(like, torch.Tensor) else None
        device = self._intended(kwargs.get("device"), like, like_root)
        meta_args = tree_map(_to_meta, args)
        meta_kwargs = {
            k: v for k, v in kwargs.items() if k not in ("device", "pin_memory", "generator")
        }
        out = _on_meta(func, meta_args, {**meta_kwargs, "device": "meta"})
        # The dtype is pinned: the default dtype may differ when this is replayed.
        replay_kwargs = {**kwargs, "device": device, "dtype": out.dtype}
        call_args = tree_map(_frozen, args)
        random = None
        if func.__name__ in RANDOM and self.exact_random:
            random = _snapshot(device, kwargs.get("generator"))
            # Move the generator on (see [Note: the random stream]); a lazy `like` only
            # lends its shape, so a scratch tensor stands in for it.
            stand_in = tree_map(lambda x: _scratch(x, device) if _is_lazy(x) else x, args)
            with torch.no_grad():
                func(*stand_in, **replay_kwargs)
        call = Call(func, call_args, replay_kwargs, torch.get_default_dtype(), random)
        register(out, Root(call, device, geometry_of(out), out.dtype))
        return out

    def _intended(self, device: Any, like: Any, like_root: Root | None) -> torch.device:
        if device is not None:
            asked = (
                torch.device(device)
                if not isinstance(device, int)
                else torch.device("cuda", device)
            )
            # An explicit "meta" inside the context asks for no storage, which every tensor
            # here already lacks: it lives where the context's tensors live.
            if asked.type != "meta":
                return asked
        if like_root is not None:
            return like_root.device
        if isinstance(like, torch.Tensor) and not like.is_meta:
            return like.device
        return self.device

    def _derive(
        self,
        func: Any,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        device: torch.device,
    ) -> Any:
        out = _on_meta(func, tree_map(_to_meta, args), tree_map(_to_meta, kwargs))
        call_args, call_kwargs = tree_map(_frozen, (args, kwargs))
        random = None
        if name in RANDOM and self.exact_random:
            random = _snapshot(device, kwargs.get("generator"))
            _advance(func, call_args, call_kwargs, None)
        call = Call(func, call_args, call_kwargs, torch.get_default_dtype(), random)
        for path, tensor in _tensor_leaves(out, ()):
            if tensor.is_meta and root_of(tensor) is None:
                root = Root(call, device, geometry_of(tensor), tensor.dtype, pick=path)
                register(tensor, root)
        return out

    def _move(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tensor = args[0]
        root = root_of(tensor)
        if root is None:  # a tensor with storage moved next to a lazy one: nothing lazy here
            return func(*args, **kwargs)
        device, dtype = _move_target(name, args, kwargs)
        new_device = device if device is not None and device.type != "meta" else root.device
        dtype = dtype or tensor.dtype
        if _same_device(new_device, root.device) and dtype == tensor.dtype:
            return tensor
        out = tensor.to(dtype=dtype) if dtype != tensor.dtype else tensor.clone()
        call_args, call_kwargs = tree_map(_frozen, (args, kwargs))
        call = Call(func, call_args, call_kwargs, torch.get_default_dtype())
        register(out, Root(call, new_device, geometry_of(out), out.dtype))
        return out

    # ---- writes -----------------------------------------------------------------------------

    def _write(
        self,
        func: Any,
        name: str,
        target: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        root = root_of(target)
        if root is None:
            raise ValueError(
                f"LazyInitContext: {name} writes lazily built values into a tensor with "
                f"storage {tuple(target.shape)}; build that tensor inside the context too, or "
                f"compute this after the model is materialised"
            )
        if getattr(target, "_is_hf_initialized", False) and _from_transformers(func):
            return target  # transformers' guarded initialisers skip what it already set
        call_args, call_kwargs = tree_map(
            lambda x: TARGET if x is target else _frozen(x), (args, kwargs)
        )
        random = None
        if name in RANDOM and self.exact_random:
            random = _snapshot(root.device, kwargs.get("generator"))
            _advance(func, call_args, call_kwargs, _scratch(target, root.device))
        call = Call(func, call_args, call_kwargs, torch.get_default_dtype(), random)
        root.writes.append(Write(geometry_of(target), call))
        if _is_initialiser(func):
            return target  # nn.init-style functions: nothing to compute on meta
        return _on_meta(func, tree_map(_to_meta, args), tree_map(_to_meta, kwargs))


def _advance(func: Any, args: Any, kwargs: Any, scratch: torch.Tensor | None) -> None:
    """Run a random op once, into `scratch` for a write, to move the generator on as the eager
    op would (see [Note: the random stream]); lazily built arguments it reads (a mean, a
    probability) are computed for it and dropped after."""
    replay = Replay()

    def real(item: Any) -> Any:
        if item is TARGET:
            return scratch
        return replay.value(item) if isinstance(item, Ref) else item

    with torch.no_grad():
        func(*tree_map(real, args), **tree_map(real, kwargs))


def _write_target(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The tensor an in-place call writes to, or None for a call that writes nothing."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    if name in _METADATA_IN_PLACE:
        return None
    in_place = (name.endswith("_") and not name.startswith("__")) or name in _DUNDER_IN_PLACE
    if not in_place:
        return None
    # nn.init passes its tensor by keyword.
    first = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))
    return first if isinstance(first, torch.Tensor) else None


def _is_initialiser(func: Any) -> bool:
    module = getattr(func, "__module__", "") or ""
    return module == "torch.nn.init" or _from_transformers(func)


def _from_transformers(func: Any) -> bool:
    return (getattr(func, "__module__", "") or "").startswith("transformers")


def _is_lazy(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and root_of(value) is not None


def _frozen(value: Any) -> Any:
    """A call argument as recorded: a lazy tensor becomes a `Ref` to its current version."""
    if isinstance(value, torch.Tensor):
        ref = ref_to(value)
        if ref is not None:
            return ref
    return value


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return value.to("meta")
    return value


def _scratch(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device)


def _on_meta(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    try:
        return func(*args, **kwargs)
    except (RuntimeError, NotImplementedError) as error:
        name = getattr(func, "__name__", repr(func))
        raise RuntimeError(
            f"LazyInitContext: {name} failed on lazily built tensors, which have shapes but "
            f"no values until the model is materialised ({error}); compute values outside "
            f"the context, or after materialising"
        ) from error


def _snapshot(device: torch.device, generator: torch.Generator | None) -> RandomState:
    if generator is None:
        if device.type == "cpu":
            generator = torch.default_generator
        elif device.type == "cuda":
            # The generators exist once CUDA is initialised (torch's get_rng_state does so too).
            torch.cuda.init()
            index = device.index if device.index is not None else torch.cuda.current_device()
            generator = torch.cuda.default_generators[index]
        else:
            raise ValueError(
                f"LazyInitContext: random initialisation on {device} cannot be recorded; "
                f"use default_device='cpu' or 'cuda'"
            )
    return RandomState(generator, generator.get_state())


def _move_target(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.device | None, torch.dtype | None]:
    if name == "cpu":
        return torch.device("cpu"), None
    if name == "cuda":
        index = args[1] if len(args) > 1 else kwargs.get("device")
        device = (
            torch.device("cuda", index) if isinstance(index, int) else torch.device(index or "cuda")
        )
        return device, None
    rest = [root_of(a).device if _is_lazy(a) else a for a in args[1:]]  # type: ignore[union-attr]
    parse: Any = torch._C._nn._parse_to  # torch's own parsing of `Tensor.to`'s overloads
    device, dtype, _, _ = parse(*rest, **kwargs)
    return device, dtype


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _tensor_leaves(value: Any, path: tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, (tuple, list)):
        return [leaf for i, item in enumerate(value) for leaf in _tensor_leaves(item, (*path, i))]
    return []
