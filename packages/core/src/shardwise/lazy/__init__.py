"""`colossalai.lazy`'s path: build a model without allocating its tensors, and give them their
values when it is boosted (see [Note: lazily built models] in lazy/lazy_init.py)."""

from shardwise.lazy.lazy_init import (
    LazyInitContext,
    LazyInitialiser,
    initialiser_for,
)

__all__ = ["LazyInitContext", "LazyInitialiser", "initialiser_for"]
