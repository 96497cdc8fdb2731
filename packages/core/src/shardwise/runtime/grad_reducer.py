"""Routing of parameter gradients into chunks and their reduction in a fixed order.

[Note: why chunks are reduced in a fixed order]
Collectives are matched by call order on every rank. If each rank reduced a chunk as soon as its
own gradients were ready, a parameter used on one rank but not another (an unused branch, an
unrouted expert) would make the ranks issue reduce-scatters in different orders and mix up or
hang. So chunks are reduced in one order shared by all ranks: a ready chunk waits for the
chunks before it, and whatever is still unreduced when backward ends is reduced then, in the
same order, with zeros for gradients that never came.

The order matters for memory: a chunk early in the order whose gradients come late (or never,
for an unused branch) holds back every later chunk's gradient buffer (and at stage 3 its
gathered parameters) until backward ends. It starts as descending chunk id, or as the reverse
of the forward order when stage 3 has recorded one, and after the first synchronised backward
becomes the order in which chunks actually completed there, rank 0's, broadcast to all ranks
(chunks that never completed go last), as DDP rebuilds its buckets.

[Note: gradients in flight]
A reduction in flight holds its chunks' gradient buffers and the collective's receive buffer
until it is waited for. Waiting for them only when backward ends would hold the whole model's
gradient at its end, more than DDP's own copy, whenever the network is slower than backward:
so the oldest reduction is waited for before another starts once `max_in_flight` run, two at
stage 2 and one at stage 3, where the gather unit's next chunks need the room. While they
reduce, the next bucket fills: one filling and at most one or two reducing, as
`reduce_bucket_size` promises, whatever the speed of the network against backward. (At stage
2 one reduction at a time made backward wait for the network: 0.95 of DDP's step time on a
117M-parameter GPT here, 0.91 with two.) At stage 3 a chunk's gathered parameters are released
as soon as its gradients are complete (every backward node that reads them has run by then),
not when its reduction ends.

[Note: hooks hold the engine weakly]
torch keeps a tensor's gradient hooks in C++, where Python's garbage collector cannot see
them: a hook whose closure held the reducer (and through it the chunks, the model and its
parameters, which hold the hook) made a cycle the collector never found, so a dropped model
stayed in memory with all its chunks. A hook holds the reducer through a weak reference and
does nothing once the reducer is gone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed import ReduceOp

from shardwise import comm
from shardwise.chunk import Chunk, ChunkManager
from shardwise.chunk.accounting import gathered_held_bytes, storage_bytes, transient_bytes
from shardwise.chunk.reduction import (
    PendingReduction,
    reduce_across_replicas,
    reduce_now,
    start_reduction,
)
from shardwise.gemini import GeminiManager, Room
from shardwise.runtime.backward_end import BackwardEnd
from shardwise.runtime.gather_units import UnitMap
from shardwise.runtime.hooks import HookSet


class GradReducer:
    """Copies each parameter's gradient into its chunk as soon as autograd has accumulated it,
    and reduces chunks over ranks.

    Args:
        chunk_manager: the chunks holding the parameters.
        reduce_in_backward: reduce each chunk during backward once its gradients are complete
            (stages 0, 2 and 3, and stage 1 where `.grad` shows the average: see [Note: stage
            1 averages in backward] in chunk/grads.py); otherwise gradients accumulate
            unreduced in the chunks' full buffers until `reduce_all()` (the rest of stage 1).
            Where chunks show `.grad` (stages 0 and 1), a synchronised backward ends by
            showing it for every tensor some rank's gradient reached, as DDP does.
        overlap: launch those reductions asynchronously and wait for them when backward ends,
            so communication runs while backward computes.
        max_in_flight: with `overlap`, at most this many reductions run at once: the oldest
            is waited for before another starts (None: wait only when backward ends). See
            [Note: gradients in flight].
        bucket_bytes: gather consecutive chunks into one reduce-scatter until their gradients
            reach this many bytes (0: one reduce-scatter per chunk).
        on_reduced: called with each chunk right after it is reduced.
        on_complete: called with each chunk once its gradients of the pass are all in, before
            it is reduced: backward needs its parameters no more (stage 3 frees its payload
            there, not after the reduction: see [Note: gradients in flight]).
        gemini: the memory manager, whose budget is checked when a gradient copy allocated a
            chunk's gradient buffer (the only moment backward's model-state bytes grow); when
            it answers that the reductions in flight must finish first, they are finished here
            (see [Note: room after the reductions] in gemini/room.py).
        units: stage 3's conditional units: a chunk holding tensors of a unit is complete
            once the unit's backward is done on this rank, whichever of them got gradients
            here (see [Note: conditional units] in runtime/gather_units.py).
        learn_order: after the first synchronised backward, reduce in the order chunks
            completed there (rank 0's); otherwise keep the initial (or suggested) order.
        enter_backward: called from every gradient hook: the first call of a pass queues
            the end of backward, which calls `end_of_backward` (the model's runtime, see
            runtime/runtime.py); when not given, the reducer queues its own.
        hooks: where the gradient hooks are kept (see [Note: one owner of an engine's hooks]
            in runtime/hooks.py); a set of their own when not given.
    """

    def __init__(
        self,
        chunk_manager: ChunkManager,
        *,
        reduce_in_backward: bool,
        overlap: bool = False,
        max_in_flight: int | None = None,
        bucket_bytes: int = 0,
        on_reduced: Callable[[Chunk], None] | None = None,
        on_complete: Callable[[Chunk], None] | None = None,
        gemini: GeminiManager | None = None,
        units: UnitMap | None = None,
        learn_order: bool = True,
        enter_backward: Callable[[], None] | None = None,
        hooks: HookSet | None = None,
    ) -> None:
        self.chunk_manager = chunk_manager
        self.reduce_in_backward = reduce_in_backward
        self.overlap = overlap
        self.max_in_flight = max_in_flight
        self.bucket_bytes = bucket_bytes
        self._bucket: list[Chunk] = []
        self._bucket_filled = 0
        self._in_flight: list[PendingReduction] = []
        self.require_sync = True
        self._on_reduced = on_reduced
        self._on_complete = on_complete
        self._gemini = gemini
        # Descending chunk id: see [Note: why chunks are reduced in a fixed order].
        self._order = sorted(chunk_manager.trainable_chunks(), key=lambda c: -c.chunk_id)
        self._chunk_of = {chunk.chunk_id: chunk for chunk in self._order}
        self._learn_order = learn_order
        self._order_settled = False
        self._completed: list[int] = []
        self._next = 0
        self._complete: set[int] = set()
        # See [Note: one end of backward] in runtime/backward_end.py: the model's runtime
        # runs end_of_backward; alone (ColoDDP), the reducer queues its own.
        self._own_end: BackwardEnd | None = None
        if enter_backward is None:
            self._own_end = BackwardEnd([self.end_of_backward])
            enter_backward = self._own_end.queue
        self._enter_backward = enter_backward
        self._unreduced_passes = False
        # Hybrid sharding: gradients were reduced within the shard groups since the last
        # average across them (see reduce_across_replicas).
        self._replicas_differ = False
        self._hybrid = chunk_manager.topology.hybrid
        self._hooks = hooks if hooks is not None else HookSet()
        self._governed = units.governed if units is not None else {}
        self._unit_names = units.names if units is not None else []
        # Per chunk holding unit tensors: its other trainable tensors, and the units it waits on.
        self._plain: dict[int, frozenset[int]] = {}
        self._waits_on: dict[int, frozenset[int]] = {}
        # Per unit, the chunks holding its tensors, in chunk order.
        self._chunks_of_unit: dict[int, list[Chunk]] = {}
        governed_in: dict[int, dict[int, int]] = {}  # chunk id -> {tensor index: unit}
        for (chunk_id, index), unit in self._governed.items():
            governed_in.setdefault(chunk_id, {})[index] = unit
        for chunk in sorted(self._order, key=lambda c: c.chunk_id):
            mine = governed_in.get(chunk.chunk_id)
            if not mine:
                continue
            self._waits_on[chunk.chunk_id] = frozenset(mine.values())
            self._plain[chunk.chunk_id] = frozenset(
                i
                for i, info in enumerate(chunk.tensors)
                if info.param.requires_grad and i not in mine
            )
            for unit in self._waits_on[chunk.chunk_id]:
                self._chunks_of_unit.setdefault(unit, []).append(chunk)
        self._units_done: set[int] = set()
        self._plain_received: dict[int, set[int]] = {}
        for chunk in self._order:
            for index, info in enumerate(chunk.tensors):
                if info.param.requires_grad:  # autograd accumulates on the compute face
                    self._hooks.add(
                        info.compute.register_post_accumulate_grad_hook(
                            self._grad_hook(chunk, index)
                        )
                    )

    def _grad_hook(self, chunk: Chunk, index: int) -> Callable[[nn.Parameter], None]:
        # See [Note: hooks hold the engine weakly]: torch keeps a tensor's hooks in C++.
        reducer = weakref.ref(self)
        chunk_id = chunk.chunk_id

        def hook(param: nn.Parameter) -> None:
            owner = reducer()
            if owner is not None:  # else the engine is gone and the tensor outlived it
                owner._on_grad(owner._chunk_of[chunk_id], index, param)

        return hook

    def _on_grad(self, chunk: Chunk, index: int, param: nn.Parameter) -> None:
        unit = self._governed.get((chunk.chunk_id, index))
        self._queue_end_of_backward()
        assert param.grad is not None
        if unit is not None and unit in self._units_done:
            raise RuntimeError(
                f"the gradient of {chunk.tensors[index].name} arrived after the backward "
                f"of its gather unit {self._unit_names[unit]!r} had ended and its chunk "
                f"was reduced: it is used outside that block too. Make it a parameter of "
                f"a module outside the block, or leave the block out of gather_units"
            )
        allocates = chunk.grads.full is None
        complete = chunk.grads.add(index, param.grad)
        # The chunk now holds the gradient; dropping .grad frees the per-parameter copy
        # (stage 1 shows a view of the chunk's copy instead).
        param.grad = chunk.grads.exposed(index)
        if allocates and self._gemini is not None:
            where = f"after the gradient of {chunk.tensors[index].name}"
            if self._gemini.check_budget(where, self) is Room.AFTER_REDUCTIONS:
                self.finish_in_flight()
                self._gemini.resume()
        if chunk.chunk_id in self._waits_on:
            if unit is None:
                self._plain_received.setdefault(chunk.chunk_id, set()).add(index)
            complete = self._unit_chunk_complete(chunk.chunk_id)
        if complete:
            self._chunk_complete(chunk)

    def _queue_end_of_backward(self) -> None:
        self._enter_backward()

    def _unit_chunk_complete(self, chunk_id: int) -> bool:
        # Only what every rank sees alike counts: the unit's backward being done, never which
        # of its tensors got a gradient here (that differs between ranks).
        received = self._plain_received.get(chunk_id, set())
        return self._waits_on[chunk_id] <= self._units_done and self._plain[chunk_id] <= received

    def unit_done(self, unit: int) -> None:
        """Unit `unit`'s backward is done on this rank: its chunks may be complete."""
        self._queue_end_of_backward()
        self._units_done.add(unit)
        for chunk in self._chunks_of_unit.get(unit, []):
            if chunk.chunk_id not in self._complete and self._unit_chunk_complete(chunk.chunk_id):
                self._chunk_complete(chunk)

    def _chunk_complete(self, chunk: Chunk) -> None:
        self._complete.add(chunk.chunk_id)
        self._completed.append(chunk.chunk_id)
        if self._on_complete is not None:
            self._on_complete(chunk)
        if self.reduce_in_backward and self.require_sync:
            self._reduce_ready_in_order()

    def suggest_order(self, chunk_ids: list[int]) -> None:
        """Reduce in this order until the first backward has shown the real one; every rank
        must pass the same list (stage 3's recorded forward order, reversed)."""
        if self._order_settled:
            return
        position = {chunk_id: i for i, chunk_id in enumerate(chunk_ids)}
        self._order.sort(key=lambda c: position.get(c.chunk_id, len(position)))

    def _settle_order(self) -> None:
        by_id = {chunk.chunk_id: chunk for chunk in self._order}
        seen = list(dict.fromkeys(c for c in self._completed if c in by_id))
        rest = [chunk.chunk_id for chunk in self._order if chunk.chunk_id not in set(seen)]
        # On the chunks' device: NCCL only moves device tensors.
        order = torch.tensor(seen + rest, dtype=torch.int64, device=self.chunk_manager.device)
        # Over every rank: under hybrid sharding each reduction ends in an all-reduce across
        # shard groups, so all groups must reduce in one order.
        data_parallel = self.chunk_manager.topology.data_parallel
        comm.broadcast(order, 0, self.chunk_manager.stats, data_parallel)
        self._order = [by_id[chunk_id] for chunk_id in order.tolist()]
        self._order_settled = True

    def _reduce_ready_in_order(self) -> None:
        while self._next < len(self._order) and self._order[self._next].chunk_id in self._complete:
            self._reduce(self._order[self._next])
            self._next += 1

    def _reduce(self, chunk: Chunk) -> None:
        if self.bucket_bytes > 0:
            self._bucket.append(chunk)
            self._bucket_filled += chunk.padded_numel * chunk.dtypes.reduce.itemsize
            if self._bucket_filled >= self.bucket_bytes:
                self._flush_bucket()
            return
        if not self.overlap:
            self._finish(start_reduction([chunk]))
            return
        # See [Note: gradients in flight]: the oldest reductions end before this one starts.
        while self.max_in_flight is not None and len(self._in_flight) >= self.max_in_flight:
            self._finish(self._in_flight.pop(0))
        self._in_flight.append(start_reduction([chunk]))

    def _flush_bucket(self) -> None:
        """One reduce-scatter for every chunk in the bucket (see [Note: one reduction entry
        point] in chunk/reduction.py)."""
        chunks, self._bucket, self._bucket_filled = self._bucket, [], 0
        if chunks:
            self._finish(start_reduction(chunks, async_op=False))

    def _finish(self, pending: PendingReduction) -> None:
        for chunk in pending.wait(keep_full=False):
            if self._on_reduced is not None:
                self._on_reduced(chunk)

    @contextmanager
    def unsynced(self) -> Iterator[None]:
        """Leave every reduction of the backward passes run inside to the next synchronised
        one (the wrappers' `no_sync()`)."""
        previous = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = previous

    def in_flight_bytes(self) -> int:
        """Device bytes the reductions in flight hold (their chunks' gathered payloads and
        gradient buffers): what `finish_in_flight` can give back, at most."""
        return sum(transient_bytes(c) for pending in self._in_flight for c in pending.chunks)

    def retiring_bytes(self, chunks: list[Chunk]) -> int:
        """Device bytes that the next reduction's start frees, if that reduction is one of
        `chunks`' (it starts as soon as that chunk completes): the gradient buffers of the
        reductions in flight it waits for (beyond `max_in_flight`), and the gathered payloads
        of those no module uses any more. Zero where it is another chunk's."""
        if self.max_in_flight is None or self._next >= len(self._order):
            return 0
        following = self._order[self._next]
        if not any(chunk is following for chunk in chunks):
            return 0
        retiring = self._in_flight[: max(0, len(self._in_flight) + 1 - self.max_in_flight)]
        freed = 0
        for pending in retiring:
            for chunk in pending.chunks:
                freed += storage_bytes(chunk.grads.full)
                # Released when complete, unless in use: see runtime.release_if_idle.
                if not chunk.in_use and not chunk.keep_gathered:
                    freed += gathered_held_bytes(chunk)
        return freed

    def finish_in_flight(self) -> None:
        """Wait for every reduction in flight now: the memory manager needs the room their
        gathered chunks and gradient buffers hold (see [Note: room after the reductions] in
        gemini/room.py). Only waits: no rank issues a collective another does not."""
        while self._in_flight:
            self._finish(self._in_flight.pop(0))

    def end_of_backward(self) -> None:
        """Autograd finished a backward pass (see [Note: one end of backward]): reduce what
        is left, in the fixed order, and show `.grad`."""
        if self.reduce_in_backward and self.require_sync:
            for chunk in self._order[self._next :]:
                self._reduce(chunk)
            self._flush_bucket()
            for pending in self._in_flight:
                self._finish(pending)
            self._in_flight.clear()
            # This pass reduced what the passes under no_sync left: nothing is left for the step.
            self._unreduced_passes = False
            self._replicas_differ = self._hybrid
            self._expose_reached()
            if not self._order_settled and self._learn_order:
                self._settle_order()
        else:
            for chunk in self._order:
                chunk.grads.end_pass()
            self._unreduced_passes = True
            self._replicas_differ = self._hybrid
        self._start_afresh()

    def settle(self) -> None:
        """A reducer used alone (ColoDDP's), before its model's next forward: a backward pass
        that raised before autograd ended it is ended now, its gradients averaged as they
        stand (a collective every rank reaches alike when every rank caught the exception)."""
        if self._own_end is not None:
            self._own_end.settle()

    def _start_afresh(self) -> None:
        self._next = 0
        self._complete.clear()
        self._completed.clear()
        self._units_done.clear()
        self._plain_received.clear()

    def abandon_pass(self) -> None:
        """A backward pass raised before autograd ended it, and its gradients are about to
        be dropped (`zero_grad()`; see [Note: the phase of the pass] in runtime/phase.py):
        wait for the reductions it issued (collectives every rank issued alike), forget the
        chunks it completed and the bucket it was filling, and count the next pass's
        gradients afresh. Issues no collective."""
        self.finish_in_flight()
        self._bucket, self._bucket_filled = [], 0
        for chunk in self._order:
            chunk.grads.end_pass()
        self._start_afresh()

    def _expose_reached(self) -> None:
        """Show `.grad` of every tensor some rank's gradient reached, where the chunks show it
        (`GradSide.exposes`), as DDP with `find_unused_parameters=True` does after exchanging
        its map of used parameters: one all-reduce of a flag per tensor. A `.grad` already set
        counts as reached: it holds the sum of earlier passes, the same on every rank once
        averaged."""
        chunks = [c for c in self.chunk_manager.trainable_chunks() if c.grads.exposes]
        if not chunks:
            return
        local = [info.compute.grad is not None for chunk in chunks for info in chunk.tensors]
        flags = torch.tensor(local, dtype=torch.int32, device=self.chunk_manager.device)
        data_parallel = self.chunk_manager.topology.data_parallel
        comm.all_reduce(flags, self.chunk_manager.stats, data_parallel, op=ReduceOp.MAX)
        reached = flags.bool().tolist()
        offset = 0
        for chunk in chunks:
            chunk.grads.expose_reached(reached[offset : offset + len(chunk.tensors)])
            offset += len(chunk.tensors)

    @property
    def has_unreduced_passes(self) -> bool:
        """Whether backward passes left gradients that `reduce_all()` would reduce."""
        return self._unreduced_passes

    def reduce_all(self) -> None:
        """Reduce the gradients that backward passes left unreduced (every pass where stage 1
        reduces at the step, passes under no_sync otherwise), every chunk in the fixed order;
        under hybrid sharding, then average the gradient shards across the shard groups.
        Whether anything is left depends only on the passes run, which every rank runs alike,
        so all ranks agree."""
        if self._unreduced_passes:
            for chunk in self._order:
                reduce_now([chunk], keep_full=not self.reduce_in_backward)
                if self._on_reduced is not None:
                    self._on_reduced(chunk)
            self._unreduced_passes = False
        if self._replicas_differ:
            reduce_across_replicas(self.chunk_manager)
            self._replicas_differ = False

    def remove(self) -> None:
        self._hooks.remove()
