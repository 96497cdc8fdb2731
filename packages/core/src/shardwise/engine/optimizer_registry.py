"""One optimizer per wrapped model: which optimizer steps a model's shards.

Kept here rather than on the model, which knows nothing of the optimizer above it; both are
held weakly. The registry holds any object: `engine.optimizer.optimizer_of` gives it its type.
"""

from __future__ import annotations

import weakref

from shardwise.engine.model import ZeroModel

_OPTIMIZER_OF: weakref.WeakKeyDictionary[ZeroModel, weakref.ref[object]] = (
    weakref.WeakKeyDictionary()
)


def registered_optimizer(model: ZeroModel) -> object | None:
    """The optimizer registered over `model`, while it is alive and not unregistered."""
    ref = _OPTIMIZER_OF.get(model)
    return ref() if ref is not None else None


def check_no_optimizer_yet(model: ZeroModel) -> None:
    """Refuse a second optimizer over one model: both would step the same shards."""
    current = registered_optimizer(model)
    if current is not None:
        raise ValueError(
            f"this model already has a ZeroOptimizer ({current!r}); one optimizer drives a "
            f"model's shards: use parameter groups instead of a second optimizer, or call "
            f"close() on the first one before wrapping another"
        )


def register_optimizer(model: ZeroModel, optimizer: object) -> None:
    """`optimizer` steps `model`'s shards from now on."""
    _OPTIMIZER_OF[model] = weakref.ref(optimizer)


def unregister_optimizer(model: ZeroModel, optimizer: object) -> None:
    """`optimizer` no longer steps `model`'s shards (closed); another may be wrapped."""
    if registered_optimizer(model) is optimizer:
        del _OPTIMIZER_OF[model]


__all__ = [
    "check_no_optimizer_yet",
    "register_optimizer",
    "registered_optimizer",
    "unregister_optimizer",
]
