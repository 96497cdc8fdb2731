"""Stages 1 and 2: the all-gather of updated parameters, overlapped with the next forward.

[Note: deferred parameter gathers]
After a stage-1/2 step each rank holds the new values of its own slice only, and an all-gather
makes the kept full copies whole again: on a 2-core gloo host that all-gather costs about as
much as the gradient reduce-scatter (benchmarks/RESULTS.md), and unlike the reduce-scatter it
cannot overlap backward. With `overlap_param_gather` the step starts the all-gathers and
returns; each module waits, just before it runs, for the chunks holding its own parameters, so
the gathers of later layers proceed while the first layers compute. The root's forward waits
for whatever is left when it ends, and anything that rewrites a chunk (a load, the next step)
waits first. The numbers are the same as without it. A parameter whose chunk is still being
gathered is a `PendingParameter` (chunk/parameters.py): any read of its values outside the
module's forward (`p.data`, `p.sum()`, a state dict, a copy) waits for that chunk's gather
first, so no code sees a half-updated parameter; reading only its shape or dtype does not wait.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.chunk import Chunk, ChunkManager
from shardwise.runtime.hooks import HookSet


class DeferredParamGather:
    """Forward pre-hooks that wait for the background gathers of a module's own chunks.

    Args:
        module: the user's model.
        chunk_manager: its chunks (kept gathered: stages 1 and 2).
        hooks: where the pre-hooks are kept (see [Note: one owner of an engine's hooks] in
            runtime/hooks.py); a set of their own when not given.
    """

    def __init__(
        self, module: nn.Module, chunk_manager: ChunkManager, hooks: HookSet | None = None
    ) -> None:
        self._chunks = list(chunk_manager.trainable_chunks())
        self._hooks = hooks if hooks is not None else HookSet()
        for submodule in module.modules():
            owned = [p for p in submodule.parameters(recurse=False) if chunk_manager.manages(p)]
            chunks = list({id(c): c for c in (chunk_manager.locate(p)[0] for p in owned)}.values())
            if chunks:
                self._hooks.add(submodule.register_forward_pre_hook(self._waiter(chunks)))

    @staticmethod
    def _waiter(chunks: list[Chunk]) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            for chunk in chunks:
                chunk.payload.wait_publish()

        return hook

    def wait_all(self) -> None:
        for chunk in self._chunks:
            chunk.payload.wait_publish()

    def remove(self) -> None:
        self._hooks.remove()
