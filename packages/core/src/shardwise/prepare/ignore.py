"""Parameters a data-parallel wrapper leaves alone: `set_params_to_ignore` marks them.

[Note: ignored parameters]
An ignored parameter is not broadcast, not put in a chunk, not reduced and not sharded: it stays
an ordinary tensor of the user's module on each rank, with each rank's own value and, after
backward, each rank's own local gradient (a user syncs it as they wish, e.g. a custom reduction
or an expert that lives on one rank only). The mark is an attribute on the parameter itself,
not a registry of ids: ids are reused after a tensor is freed, and the mark must follow the
parameter into whatever module holds it. It must be set before the wrapper is built, as in
ColossalAI, whose `ColoDDP` / `ZeroDDP.set_params_to_ignore` this mirrors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

_IGNORE_MARK = "_shardwise_ddp_ignore"


def mark_ignored(params_to_ignore: Iterable[torch.Tensor]) -> None:
    """Mark each parameter as ignored by the data-parallel wrappers (see the note)."""
    if isinstance(params_to_ignore, torch.Tensor):
        raise TypeError(
            "params_to_ignore must be an iterable of parameters, got a single tensor; pass [param]"
        )
    for param in params_to_ignore:
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"params_to_ignore must hold tensors, got {type(param).__name__}")
        setattr(param, _IGNORE_MARK, True)


def is_ignored(param: torch.Tensor) -> bool:
    """Whether `param` was marked by `set_params_to_ignore`."""
    return bool(getattr(param, _IGNORE_MARK, False))


def keep_ignored_local(
    params: Iterable[nn.Parameter],
    compute_dtype: torch.dtype,
    device: torch.device,
    make_whole: Callable[[nn.Parameter], None],
) -> None:
    """Ready the ignored ones among `params` to run beside chunked parameters: whole (a
    ZeroInitContext builds them sliced), on the compute device and, when floating point, in
    the compute dtype the wrapper casts inputs to (as ColossalAI's ZeroDDP casts them to
    fp16)."""
    for param in params:
        if not is_ignored(param):
            continue
        make_whole(param)
        dtype = compute_dtype if param.is_floating_point() else param.dtype
        if param.dtype != dtype or param.device != device:
            param.data = param.data.to(device, dtype)
