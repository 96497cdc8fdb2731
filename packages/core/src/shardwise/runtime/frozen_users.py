"""Stage 3's frozen chunks, released in backward as soon as the units using them are done.

[Note: frozen chunks in backward]
A trainable chunk is released in backward once its gradients are reduced. A frozen one (a
LoRA model's base weights) gets no gradient to say so: backward gathers it for the units that
propagate gradients through it, and it would stay gathered until backward ends, so a frozen
model would be held whole on every rank at the end of backward. So each call of a unit holding
frozen chunks, when its output needs a gradient, counts as a user of them from its backward's
start (the output's gradient) until the gradients of its inputs are computed (a multi-grad
hook), when its backward is over; a frozen chunk is released when its last user is done. A
unit whose inputs need no gradient gives no such signal: its chunks are released when backward
ends, as before. A later unit needing a released chunk gathers it again. Every rank runs the
same graph, so every rank releases, and gathers again, alike.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from shardwise.chunk import Chunk, ChunkManager
from shardwise.runtime.phase import PassState, Phase


class FrozenUsers:
    """The unit calls whose backward runs now, per frozen chunk (see [Note: frozen chunks in
    backward]).

    Args:
        chunk_manager: the chunks.
        state: the phase of the pass (a release happens only in backward).
        releasable: whether a chunk no unit uses any more may be released now.
    """

    def __init__(
        self,
        chunk_manager: ChunkManager,
        state: PassState,
        releasable: Callable[[Chunk], bool],
    ) -> None:
        self._chunks = chunk_manager.chunks
        self._state = state
        self._releasable = releasable
        self._users: dict[int, int] = {}

    def watch(self, args: Any, output: Any, frozen: list[Chunk]) -> None:
        """A unit call holding `frozen` chunks ran forward with `args` and gave `output`: its
        backward opens with the output's gradient and closes with its inputs'."""
        inputs = [
            value
            for value in tree_flatten(args)[0]
            if isinstance(value, torch.Tensor) and value.requires_grad
        ]
        outputs = [
            value
            for value in tree_flatten(output)[0]
            if isinstance(value, torch.Tensor) and value.requires_grad
        ]
        if not inputs or not outputs:
            return
        opened = [False]
        # The hooks live in the autograd graph, which the user may keep (the last loss): they
        # hold this object weakly and the chunks by id (see [Note: hooks hold the engine
        # weakly] in runtime/grad_reducer.py).
        users = weakref.ref(self)
        frozen_ids = tuple(chunk.chunk_id for chunk in frozen)

        def backward_started(grad: torch.Tensor) -> None:
            owner = users()
            if owner is not None and not opened[0]:
                opened[0] = True
                owner._opened(frozen_ids)

        def backward_done(grads: Any) -> None:
            owner = users()
            if owner is None or not opened[0] or owner._state.phase is not Phase.PRE_BACKWARD:
                return
            opened[0] = False
            owner._closed(frozen_ids)

        for tensor in outputs:
            tensor.register_hook(backward_started)
        torch.autograd.graph.register_multi_grad_hook(inputs, backward_done)

    def _opened(self, chunk_ids: tuple[int, ...]) -> None:
        for chunk_id in chunk_ids:
            self._users[chunk_id] = self._users.get(chunk_id, 0) + 1

    def _closed(self, chunk_ids: tuple[int, ...]) -> None:
        for chunk_id in chunk_ids:
            users = self._users.get(chunk_id, 0) - 1
            self._users[chunk_id] = users
            chunk = self._chunks[chunk_id]
            if users <= 0 and self._releasable(chunk):
                chunk.payload.release()

    def clear(self) -> None:
        """Backward ended: the next one counts afresh."""
        self._users.clear()


__all__ = ["FrozenUsers"]
