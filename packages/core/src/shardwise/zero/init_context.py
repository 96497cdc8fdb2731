"""ZeroInitContext: modules built inside it keep only this rank's shard of each parameter.

[Note: sharded construction]
Right after each module's `__init__` finishes (every nn.Module subclass's `__init__` is wrapped
while the context is open), each parameter it owns directly is cut into N equal slices of its
flattened values and this rank keeps its own; the parameter then holds an empty tensor. Every
rank is seeded alike, so all compute the same values and keep complementary slices: the
numbers are those of an unsharded construction with the same seed.

Code that touches a sharded parameter later while the context is open (a root module's
`self.apply(init_weights)`, tying, reading `.shape`) goes through a TorchFunctionMode that
gathers the parameter's slices first, so it sees and changes the whole tensor; when another
parameter is touched, or the context closes, the changes are cut back into the slices. At most
the parameters of one call are whole at a time, so a rank's peak while building stays near
(model bytes / N) plus one layer. Every rank runs the same construction code, so the gathers
match across ranks. Wrapping the model keeps the promise: a parameter is made whole only just
before it is packed into a chunk, and each chunk is sharded as soon as it is full (see [Note:
packing one chunk at a time] in chunk/manager.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from shardwise import comm
from shardwise.comm import CommStats
from shardwise.prepare.slicing import SLICE_ATTRIBUTE, ParamSlice, gather_whole, sliced
from shardwise.zero.shard_strategy import BaseShardStrategy


class ZeroInitContext(TorchFunctionMode):
    """Build a model sharded from the first byte (see [Note: sharded construction]).

    Args:
        target_device: where the slices live.
        shard_strategy: the strategy ShardedModelV2 will pack with (kept for it).
        seed: seeds torch on every rank alike, so all build the same numbers.
        shard_param: slice parameters; with False, modules are only built on `target_device`.
        default_dtype: dtype of floating-point parameters built inside (default: unchanged).
        process_group: ranks to slice over (default: the default group).
        model_numel_tensor: if given, receives the number of parameter elements built.
    """

    def __init__(
        self,
        target_device: torch.device,
        shard_strategy: BaseShardStrategy,
        seed: int = 2**10 - 1,
        shard_param: bool = True,
        default_dtype: torch.dtype | None = None,
        process_group: ProcessGroup | None = None,
        model_numel_tensor: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(target_device, torch.device):
            raise TypeError(f"target_device must be a torch.device, got {target_device!r}")
        if not isinstance(shard_strategy, BaseShardStrategy):
            raise TypeError(
                f"shard_strategy must be a TensorShardStrategy or BucketTensorShardStrategy, "
                f"got {type(shard_strategy).__name__}"
            )
        self.target_device = target_device
        self.shard_strategy = shard_strategy
        self.seed = seed
        self.shard_param = shard_param
        self.default_dtype = default_dtype
        self.process_group = process_group
        self.model_numel_tensor = model_numel_tensor
        self.stats = CommStats()
        self.bytes_whole_peak = 0
        self._whole: dict[int, nn.Parameter] = {}
        self._sliced: dict[int, nn.Parameter] = {}
        self._patched: list[tuple[type, Callable[..., None]]] = []
        self._previous_dtype = torch.get_default_dtype()

    # ---- entering and leaving ---------------------------------------------------------------

    def __enter__(self) -> ZeroInitContext:
        torch.manual_seed(self.seed)
        if self.default_dtype is not None:
            torch.set_default_dtype(self.default_dtype)
        for cls in _module_classes():
            if "__init__" in cls.__dict__:
                self._wrap_init(cls)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._cut_all()
        for cls, original in reversed(self._patched):
            cls.__init__ = original  # type: ignore[misc]
        self._patched.clear()
        torch.set_default_dtype(self._previous_dtype)

    def _wrap_init(self, cls: type) -> None:
        original = cls.__dict__["__init__"]
        context = self

        def init(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            original(module, *args, **kwargs)
            context._after_init(module)

        init.__wrapped__ = original  # type: ignore[attr-defined]
        cls.__init__ = init  # type: ignore[misc]
        self._patched.append((cls, original))

    def _after_init(self, module: nn.Module) -> None:
        for param in module.parameters(recurse=False):
            if id(param) in self._sliced or id(param) in self._whole:
                continue
            with torch._C.DisableTorchFunction():
                param.data = param.data.to(self.target_device)
                if self.model_numel_tensor is not None:
                    self.model_numel_tensor += param.numel()
                if self.shard_param:
                    self._slice(param)

    # ---- slicing ----------------------------------------------------------------------------

    def _slice(self, param: nn.Parameter) -> None:
        world, rank = comm.world_size(self.process_group), comm.rank(self.process_group)
        numel = param.numel()
        per_rank = -(-numel // world)
        flat = param.data.reshape(-1)
        values = torch.zeros(per_rank, dtype=flat.dtype, device=flat.device)
        begin, end = rank * per_rank, min(numel, (rank + 1) * per_rank)
        if end > begin:
            values[: end - begin].copy_(flat[begin:end])
        setattr(param, SLICE_ATTRIBUTE, ParamSlice(values, param.shape, numel))
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._sliced[id(param)] = param

    def _make_whole(self, param: nn.Parameter) -> None:
        with torch._C.DisableTorchFunction():
            param.data = gather_whole(param, self.stats, self.process_group)
        del self._sliced[id(param)]
        self._whole[id(param)] = param
        self.bytes_whole_peak = max(
            self.bytes_whole_peak, sum(p.numel() * p.element_size() for p in self._whole.values())
        )

    def _cut(self, param: nn.Parameter) -> None:
        """Write a whole parameter's (possibly changed) values back into this rank's slice."""
        with torch._C.DisableTorchFunction():
            piece: ParamSlice = getattr(param, SLICE_ATTRIBUTE)
            rank = comm.rank(self.process_group)
            per_rank = piece.values.numel()
            flat = param.data.reshape(-1)
            begin, end = rank * per_rank, min(piece.numel, (rank + 1) * per_rank)
            if end > begin:
                piece.values[: end - begin].copy_(flat[begin:end])
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        del self._whole[id(param)]
        self._sliced[id(param)] = param

    def _cut_all(self) -> None:
        for param in list(self._whole.values()):
            if sliced(param):
                self._cut(param)
            else:
                del self._whole[id(param)]

    # ---- the mode ---------------------------------------------------------------------------

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        touched = [
            t
            for t in leaves
            if isinstance(t, torch.Tensor) and (id(t) in self._sliced or id(t) in self._whole)
        ]
        if touched:
            wanted = {id(t) for t in touched}
            for param in list(self._whole.values()):
                if id(param) not in wanted and sliced(param):
                    self._cut(param)
            for tensor in touched:
                if id(tensor) in self._sliced:
                    self._make_whole(self._sliced[id(tensor)])
        return func(*args, **kwargs)


def _module_classes() -> list[type]:
    """nn.Module and every subclass defined so far."""
    found: list[type] = []
    pending = [nn.Module]
    while pending:
        cls = pending.pop()
        if cls not in found:
            found.append(cls)
            pending.extend(cls.__subclasses__())
    return found
