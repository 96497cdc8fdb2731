"""One optimizer per wrapped model: which `ZeroOptimizer` steps a model's shards."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from shardwise.engine.model import ZeroModel

if TYPE_CHECKING:
    from shardwise.engine.optimizer import ZeroOptimizer

# The ZeroOptimizer stepping each model's shards (one at a time), held weakly both ways: kept
# here rather than on the model, which knows nothing of the optimizer above it.
_OPTIMIZER_OF: weakref.WeakKeyDictionary[ZeroModel, weakref.ref[ZeroOptimizer]] = (
    weakref.WeakKeyDictionary()
)


def optimizer_of(model: ZeroModel) -> ZeroOptimizer | None:
    """The optimizer wrapped over `model`, while it is alive and not closed."""
    ref = _OPTIMIZER_OF.get(model)
    return ref() if ref is not None else None


def check_no_optimizer_yet(model: ZeroModel) -> None:
    """Refuse a second optimizer over one model: both would step the same shards."""
    current = optimizer_of(model)
    if current is not None:
        raise ValueError(
            f"this model already has a ZeroOptimizer ({current!r}); one optimizer drives a "
            f"model's shards: use parameter groups instead of a second optimizer, or call "
            f"close() on the first one before wrapping another"
        )


def register_optimizer(model: ZeroModel, optimizer: ZeroOptimizer) -> None:
    """`optimizer` steps `model`'s shards from now on."""
    _OPTIMIZER_OF[model] = weakref.ref(optimizer)


def unregister_optimizer(model: ZeroModel, optimizer: ZeroOptimizer) -> None:
    """`optimizer` no longer steps `model`'s shards (closed); another may be wrapped."""
    if optimizer_of(model) is optimizer:
        del _OPTIMIZER_OF[model]


__all__ = ["check_no_optimizer_yet", "optimizer_of", "register_optimizer", "unregister_optimizer"]
