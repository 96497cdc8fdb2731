"""Stage 3: gather each chunk just before a module that uses it runs, release it after.

[Note: recorded execution order]
The first forward and backward of a model record which chunks each module call needs, in
order. From then on that record drives three things: a chunk is released in forward right after
the last module call that uses it (so a tied embedding used again by the head stays gathered);
the next chunk the record needs, beyond those of the current call, is gathered asynchronously
while the current modules compute; and the chunks backward starts with stay gathered from the
end of a forward run with gradients on, since backward would gather them again at once.
The first pass, having no record yet, releases a chunk once every tensor in it has been used
(a tied weight is then gathered again when reused). If a later pass departs from the record
(data-dependent control flow) the rest of that pass falls back to on-demand gathers and
releases at the end of forward: slower, never wrong. Every rank must run the same modules in
the same order, as with any ZeRO-3 engine, since gathers are collectives; a block whose
children run on some ranks only (experts behind a router) is hooked as one gather unit
instead, so its children issue none (see [Note: gather units] in zero/gather_units.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from shardwise.chunk import Chunk, ChunkManager, ChunkState, TensorState
from shardwise.gemini import GeminiManager
from shardwise.zero.gather_units import UnitMap
from shardwise.zero.rank_sync import VisitTrail

# How many module calls ahead a prefetch looks for the next chunk the pass needs.
_LOOKAHEAD = 256


class _Trace:
    """The chunk ids each module call needed, in order, with replay bookkeeping."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, ...]] = []
        self.recorded = False
        self.position = 0
        self.on_track = True
        self._ahead: list[tuple[int, ...]] = []

    def begin(self) -> None:
        self.position = 0
        self.on_track = self.recorded

    def visit(self, chunk_ids: tuple[int, ...]) -> None:
        if not self.recorded:
            self.steps.append(chunk_ids)
        elif self.on_track and (
            self.position >= len(self.steps) or self.steps[self.position] != chunk_ids
        ):
            self.on_track = False
        self.position += 1

    def upcoming(self) -> tuple[int, ...]:
        """The chunks the pass needs next, beyond those of the module call just visited."""
        if self.on_track and 0 < self.position <= len(self._ahead):
            return self._ahead[self.position - 1]
        return ()

    def finish(self) -> None:
        if not self.recorded and self.steps:
            self.recorded = True
            self._ahead = [self._next_new_chunks(p) for p in range(len(self.steps))]

    def _next_new_chunks(self, position: int) -> tuple[int, ...]:
        # A run of module calls over the same chunks (the blocks packed in one chunk) would
        # give the next chunk's gather only the run's last call to hide behind: look past it.
        current = set(self.steps[position])
        for later in self.steps[position + 1 : position + 1 + _LOOKAHEAD]:
            new = tuple(c for c in later if c not in current)
            if new:
                return new
        return ()


class GatherScheduler:
    """Hooks on every module that directly owns managed parameters, and on every gather unit
    (for all the parameters under it; the modules inside get none).

    Args:
        module: the user's model.
        chunk_manager: its chunks (sharded, not kept gathered).
        prefetch: gather the next chunk of the recorded order asynchronously.
        gemini: the memory manager to consult around every gather (room for the chunks,
            the budget check), if any.
        on_backward: called when a backward pass starts, before its first gather.
        units: the blocks gathered as one (see [Note: gather units]); none when not given.
    """

    def __init__(
        self,
        module: nn.Module,
        chunk_manager: ChunkManager,
        *,
        prefetch: bool,
        gemini: GeminiManager | None = None,
        on_backward: Callable[[], None] | None = None,
        units: UnitMap | None = None,
    ) -> None:
        self.chunk_manager = chunk_manager
        self._on_backward = on_backward
        # A policy may forbid prefetching; "auto" allows it once its plan has room for it
        # (GeminiManager.prefetch_planned).
        self.prefetch = prefetch and (gemini is None or gemini.policy.allows_prefetch)
        self._gemini = gemini
        self._warmed_up = False
        self._forward = _Trace()
        self._backward = _Trace()
        self._last_forward_use: dict[int, int] = {}
        self._used_in_pass: dict[int, set[int]] = {}
        self._in_backward = False
        self._keep_for_backward: frozenset[int] = frozenset()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.units = units if units is not None else UnitMap(module, chunk_manager, {})
        # The modules whose hooks ran since the last pass check, compared across ranks there.
        self.trail = VisitTrail()
        for name, submodule in module.named_modules():
            if self.units.inside_unit(submodule):
                continue  # its unit gathers for it: see [Note: gather units]
            unit = self.units.index_of(submodule)
            params = submodule.parameters(recurse=unit is not None)
            places = [chunk_manager.locate(p) for p in params if chunk_manager.manages(p)]
            if not places:
                continue
            visit = self.trail.register(name or type(submodule).__name__)
            self._handles.append(
                submodule.register_forward_pre_hook(self._pre_forward(places, visit))
            )
            self._handles.append(submodule.register_forward_hook(self._post_forward(places, visit)))
            if unit is not None:
                self._handles.append(
                    submodule.register_forward_pre_hook(
                        self.units.watch_backward(unit), with_kwargs=True
                    )
                )

    # ---- forward -----------------------------------------------------------------------------

    def begin_forward(self) -> None:
        self._forward.begin()
        self._used_in_pass.clear()
        self._keep_for_backward = self._needed_first_by_backward()

    def forward_order(self) -> list[int]:
        """Chunk ids by first use in the recorded forward pass (empty before it is recorded)."""
        if not self._forward.recorded:
            return []
        return list(dict.fromkeys(c for step in self._forward.steps for c in step))

    def end_forward(self) -> None:
        """Release every chunk not in use, except those backward needs first; record the
        forward order after the first pass."""
        if not self._forward.recorded:
            self._forward.finish()
            self._last_forward_use = {
                chunk_id: position
                for position, chunk_ids in enumerate(self._forward.steps)
                for chunk_id in chunk_ids
            }
        keep = self._keep_for_backward if self._forward.on_track else frozenset()
        self.release_all(keep=keep, keep_secondary=torch.is_grad_enabled())

    def _needed_first_by_backward(self) -> frozenset[int]:
        # Backward starts with the modules forward ended with: releasing their chunks only to
        # gather them again at once would cost an all-gather nothing can hide. Kept only when
        # a backward can follow (gradients are on) and the pass follows the record; under
        # "auto" only once its plan has room for the prefetch too.
        if not self._prefetching() or not self._backward.recorded or not torch.is_grad_enabled():
            return frozenset()
        return frozenset(self._backward.steps[0])

    def _pre_forward(self, places: list[tuple[Chunk, int]], visit: int) -> Any:
        chunks = _unique_chunks(places)
        chunk_ids = tuple(chunk.chunk_id for chunk in chunks)

        def hook(module: nn.Module, args: Any) -> None:
            trace = self._backward if self._in_backward else self._forward
            trace.visit(chunk_ids)
            self.trail.add(visit)
            self._gather(chunks, self._in_backward, f"before forward of {type(module).__name__}")
            for chunk, index in places:
                chunk.set_compute(index)
            self._prefetch(trace)

        return hook

    def _gather(self, chunks: list[Chunk], backward: bool, where: str) -> None:
        """Gather `chunks`, consulting the memory manager only when one is actually sharded
        (nothing grows otherwise: this runs for every module call)."""
        sharded = [chunk for chunk in chunks if chunk.state is ChunkState.SHARDED]
        if not sharded:
            return
        if self._gemini is not None:
            self._gemini.before_gather(sharded, backward=backward)
        for chunk in sharded:
            chunk.gather()
        if self._gemini is not None:
            self._gemini.after_gather(sharded, where)

    def _post_forward(self, places: list[tuple[Chunk, int]], visit: int) -> Any:
        chunks = _unique_chunks(places)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            position = self._forward.position - 1
            for chunk, index in places:
                chunk.set_hold(index)
            if not self._in_backward and not self._forward.recorded:
                self._release_fully_used(places)
            elif not self._in_backward and self._forward.on_track:
                for chunk in chunks:
                    if (
                        self._last_forward_use.get(chunk.chunk_id) == position
                        and chunk.chunk_id not in self._keep_for_backward
                        and not chunk.in_use
                        and not chunk.keep_gathered
                    ):
                        chunk.release(keep_secondary=torch.is_grad_enabled())
            if torch.is_grad_enabled():
                self._register_pre_backward(output, chunks, visit)

        return hook

    def _release_fully_used(self, places: list[tuple[Chunk, int]]) -> None:
        """First pass: release a chunk once each of its tensors has been used."""
        for chunk, index in places:
            self._used_in_pass.setdefault(chunk.chunk_id, set()).add(index)
        for chunk in _unique_chunks(places):
            used = len(self._used_in_pass[chunk.chunk_id])
            if used == len(chunk.tensors) and not chunk.in_use and not chunk.keep_gathered:
                chunk.release(keep_secondary=torch.is_grad_enabled())

    # ---- backward ----------------------------------------------------------------------------

    def _register_pre_backward(self, output: Any, chunks: list[Chunk], visit: int) -> None:
        chunk_ids = tuple(chunk.chunk_id for chunk in chunks)

        def hook(grad: torch.Tensor) -> None:
            if not self._in_backward:
                self._in_backward = True
                self._backward.begin()
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
                if self._on_backward is not None:
                    self._on_backward()
            self._backward.visit(chunk_ids)
            self.trail.add(visit)
            self._gather(chunks, True, "before backward")
            self._prefetch(self._backward)

        leaves, _ = tree_flatten(output)
        for tensor in leaves:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(hook)

    def _end_backward(self) -> None:
        self._in_backward = False
        self.units.end_backward()
        self._backward.finish()
        # Nothing computes once backward has ended. A module's re-run forward under
        # non-reentrant checkpointing stops as soon as it has recomputed what backward needs,
        # which may be before the module's own forward hook marks its tensors done.
        for chunk in self.chunk_manager.chunks:
            for index, info in enumerate(chunk.tensors):
                if info.state is TensorState.COMPUTE:
                    chunk.set_hold(index)
        self.release_all()
        if self.chunk_manager.topology.secondary is not None:  # hpZ
            for chunk in self.chunk_manager.chunks:
                chunk.drop_secondary()  # what backward did not gather (an unused branch)
        if self._gemini is not None and not self._warmed_up:
            self._warmed_up = True
            self._gemini.end_of_warmup()

    # ---- shared ------------------------------------------------------------------------------

    def _prefetching(self) -> bool:
        # Every rank decides alike: a prefetch is a collective.
        return self.prefetch and (self._gemini is None or self._gemini.prefetch_planned)

    def _prefetch(self, trace: _Trace) -> None:
        if not self._prefetching():
            return
        for chunk_id in trace.upcoming():
            chunk = self.chunk_manager.chunks[chunk_id]
            if chunk.state is ChunkState.SHARDED and not chunk.gather_pending:
                if self._gemini is not None:
                    self._gemini.before_prefetch([chunk], backward=self._in_backward)
                chunk.start_gather()
                if self._gemini is not None:
                    self._gemini.check_budget(f"after prefetching chunk {chunk_id}")

    def release_done(self, chunk: Chunk) -> None:
        """Backward needs `chunk`'s parameters no more: its gradients are complete, or
        reduced."""
        if not chunk.in_use and not chunk.keep_gathered:
            chunk.release()

    def release_all(
        self, keep: frozenset[int] = frozenset(), *, keep_secondary: bool = False
    ) -> None:
        """Release every gathered (or prefetching) chunk not in use, but those in `keep`;
        with `keep_secondary`, each keeps its secondary copy for backward (hpZ)."""
        for chunk in self.chunk_manager.chunks:
            if (
                (chunk.state is ChunkState.GATHERED or chunk.gather_pending)
                and chunk.chunk_id not in keep
                and not chunk.in_use
                and not chunk.keep_gathered
            ):
                chunk.release(keep_secondary=keep_secondary)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _unique_chunks(places: list[tuple[Chunk, int]]) -> list[Chunk]:
    seen: dict[int, Chunk] = {}
    for chunk, _ in places:
        seen.setdefault(chunk.chunk_id, chunk)
    return list(seen.values())
