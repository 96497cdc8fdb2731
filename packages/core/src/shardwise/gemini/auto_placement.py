"""The "auto" policy: chunk shards move between device and host as a traced step demands.

[Note: auto placement]
Every chunk starts where the wrap's plan put it (see [Note: auto places from the wrap] in
wrap_plan.py): shards and optimizer sides on the device as a share of the budget allows, the
rest in host memory. The first forward and backward are the warm-up: a MemoryTracer samples the
non-model bytes at each module boundary and the order in which boundaries use chunks is
recorded. Before each boundary gathers its chunks, the device must have room for them (what a
prefetch has not allocated yet and, in backward, their gradient buffers, less the reduction in
flight that the next reduction's start frees) within the budget less the non-model bytes traced
there; if it has not, reductions still in flight are finished (only where that makes the room,
or where the model state alone passes the budget: waiting cannot make room for activations and
would serialise the step's reductions; the caller finishes them, see [Note: room after the
reductions] in room.py) and shards resident on the device are sent to host memory, the one used
again farthest in the future first (during warm-up, when the future is unknown, the least
recently used first). A shard gathered from host memory is copied to the device for the gather
and stays in its pool.

The plan is a forecast, so the budget check after every allocation (a gather, a gradient
buffer, a prefetch) does the same: over the budget, it finishes the reductions in flight (on
the same terms), evicts shards, and as a last resort sends optimizer sides back to host memory,
then carries on. It raises only when the model state still passes the budget with nothing left
to move: then the chunks gathered and the gradient buffers alone pass it, and "cpu" placement,
which keeps only that on the device, cannot train either. Non-model memory is planned for but
cannot be moved: where the working set and the activations together pass the budget, "auto"
keeps only the working set on the device, as "cpu" does, and trains.

At the end of warm-up the plan is fixed. A prefetch of the next chunk is planned if one more
gathered chunk fits beside the largest working set on every rank (agreed over ranks: a
prefetch is a collective, so every rank must issue it or none). Then, against the warm-up's
peak (the largest working set plus the traced activations) and room for two more gathered
chunks (a prefetched one, one kept from forward into backward), shards stay on the device
where they fit, the most used first, and then optimizer sides (fp32 master,
gradient shard, optimizer state) move to the device, chunk by chunk in chunk order, into the
room left, or into `margin_ratio` of it when one is given, so those chunks step there. A shard
on the device saves its gathers' host-to-device copies, an optimizer side the gradient's trip
to host memory and the updated parameters' trip back: shards come first, as they save more
bytes for each byte of device memory. Ties go to the higher chunk id: nothing depends on set or
dict iteration order.

Where the warm-up's peak and that reserved room fit within the budget, the plan keeps what
it places on the device within what is left, so a step that repeats the warm-up needs no room
made before its gathers: they skip that forecast (its cost per gather is the whole of auto's
overhead over a static split there), and the budget checks after each allocation stand guard.
One of those that has to evict turns the forecast back on until the step's new plan.

A step that makes room by evicting what the plan kept on the device (it allocated more than the
warm-up did: gradients held whole under `no_sync`, a larger batch) sets a flag that rides in
the step's gradient-norm all-reduce; after a step where any rank set it, every rank sends its
shards and optimizer sides back to host memory and plans again against the largest working set
seen so far (`replan`), so the same steps keep to the new plan.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from functools import partial

import torch

from shardwise.chunk import Chunk, ChunkManager, ChunkState, Pool
from shardwise.chunk.accounting import gathered_bytes, gathered_held_bytes
from shardwise.gemini.collaborators import NO_REDUCTIONS, ReductionsInFlight
from shardwise.gemini.passes import Pass
from shardwise.gemini.room import Room
from shardwise.gemini.tracer import MemoryTracer


class AutoPlacer:
    """Evictions and promotions of chunk shards for the "auto" policy.

    Args:
        chunk_manager: the chunks.
        budget: device bytes allowed, model state and non-model memory together.
        margin_ratio: share of the room left after warm-up given to optimizer sides (None:
            all of it).
        device_bytes: the model-state bytes on the device now.
        chunk_device_bytes: the same for one chunk (evictions subtract what they freed
            rather than count every chunk again).
        tracer: the non-model memory sampler.
        evict_optim: sends a chunk's optimizer side to host memory (the manager's move, which
            re-points the optimizer too).
    """

    def __init__(
        self,
        chunk_manager: ChunkManager,
        *,
        budget: int,
        margin_ratio: float | None,
        device_bytes: Callable[[], int],
        chunk_device_bytes: Callable[[Chunk], int],
        tracer: MemoryTracer,
        evict_optim: Callable[[Chunk], None],
    ) -> None:
        self.chunk_manager = chunk_manager
        self.budget = budget
        self.margin_ratio = margin_ratio
        self._device_bytes = device_bytes
        self._chunk_device_bytes = chunk_device_bytes
        self.tracer = tracer
        self.warm = False
        self.timeline: list[tuple[int, ...]] = []
        self.non_model: list[int] = []
        self.warmup_peak = 0
        self.evictions = 0
        self.overruns = 0
        # Overruns since the plan was last made, and how often it was made again.
        self.overruns_since_plan = 0
        self.replans = 0
        self.prefetch = False
        # The most bytes the step's working set (gathered chunks, gradient buffers) took.
        self.working_peak = 0
        # Room the plan keeps free for a prefetch and a chunk kept into backward.
        self.reserved_bytes = 0
        # The plan keeps the warm-up's peak and that room within the budget, so steps that
        # repeat the warm-up need no room made before their gathers (see [Note: auto
        # placement]).
        self.plan_holds = False
        # A decision paused for the caller to finish the reductions in flight (see [Note: room
        # after the reductions] in room.py), resumed by `resume()`.
        self._paused: Callable[[], Room] | None = None
        # Sends a chunk's optimizer side back to host memory (the manager's move).
        self.evict_optim = evict_optim
        self._position = 0
        # After warm-up: the traced non-model bytes at the current position of the step.
        self._planned_non_model = 0
        self._last_use: dict[int, int] = {}
        self._uses: dict[int, list[int]] = {}
        # Per chunk id: the bytes its gather and its gradient buffer allocate.
        self._gathered: dict[int, int] = {}
        self._grad_buffer: dict[int, int] = {}

    def begin_step(self) -> None:
        self._position = 0
        self._planned_non_model = self.non_model[0] if self.non_model else 0

    def restart_warmup(self) -> None:
        """The warm-up's backward raised midway: forget the timeline it recorded, so the next
        forward and backward record a whole step afresh (see [Note: the phase of the pass] in
        runtime/phase.py)."""
        assert not self.warm, "the warm-up has ended: its plan is made"
        self.timeline.clear()
        self.non_model.clear()
        self._last_use.clear()
        self._position = 0

    def non_model_now(self) -> int:
        """The non-model bytes on the device now: sampled during warm-up, then those traced at
        the same point of the warm-up step (asked at every check: kept, not looked up)."""
        return self._planned_non_model if self.warm else self.tracer.sample()

    def before_gather(
        self, chunks: list[Chunk], serving: Pass, reductions: ReductionsInFlight = NO_REDUCTIONS
    ) -> Room:
        """Make room on the device for `chunks` (see [Note: auto placement]), weighing the
        model's gradient `reductions` in flight (what they hold, which finishing them frees)."""
        position = self._position
        self._position += 1
        if self.warm:
            traced = self.non_model
            if traced:
                self._planned_non_model = traced[min(position, len(traced) - 1)]
        else:
            ids = tuple(c.chunk_id for c in chunks)
            self.timeline.append(ids)
            self.non_model.append(self.tracer.sample())
            for chunk_id in ids:
                self._last_use[chunk_id] = position
        # In backward the gradient buffers of the chunks gathered for a module arrive with
        # its gradients, right after the gather.
        return self.make_room(
            chunks, with_grads=serving is Pass.BACKWARD, reductions=reductions, position=position
        )

    def make_room(
        self,
        chunks: list[Chunk],
        with_grads: bool,
        reductions: ReductionsInFlight = NO_REDUCTIONS,
        position: int | None = None,
        *,
        drained: bool = False,
    ) -> Room:
        """Evict shards until `chunks` fit beside the device's model state and the non-model
        bytes planned here (with their gradient buffers, when those arrive before anything is
        freed); leave the rest to the budget check after the allocation. Where finishing the
        reductions in flight is worth it, answer `Room.AFTER_REDUCTIONS` first (`drained`:
        the caller has just finished them)."""
        if self.plan_holds:
            return Room.MADE
        if position is None:
            position = max(self._position - 1, 0)
        gathers = grads = 0
        for chunk in chunks:
            if chunk.payload.state is ChunkState.SHARDED:
                # A prefetched chunk already holds its payload buffer, counted on the device:
                # its gather adds only what is not allocated yet (a compute copy).
                gathers += self._gathered_bytes(chunk) - gathered_held_bytes(chunk)
            if with_grads and chunk.requires_grad and chunk.grads.full is None:
                grads += self._grad_buffer_bytes(chunk)
        # Where the next reduction is one of these chunks', it starts as soon as that chunk
        # completes and waits for the one in flight: the rest of their gradient buffers take
        # its room. (A first buffer that arrives before it has left is caught by the budget
        # check at that gradient, which waits for the reduction then, as its start would a
        # moment later.)
        need = gathers
        if grads:
            need += max(0, grads - reductions.retiring_bytes(chunks))
        room = self.budget - self.non_model_now()
        if self._device_bytes() + need <= room:
            return Room.MADE
        excess = self._device_bytes() + need - room
        if not drained and self._draining_helps(excess, need, reductions):
            return self._pause(
                partial(self.make_room, chunks, with_grads, reductions, position, drained=True)
            )
        needed = {c.chunk_id for c in chunks}
        while excess > 0:
            victim = self._victim(needed, position)
            if victim is None:
                break
            excess -= self._move(victim, lambda c: c.move_payload(Pool.HOST))
        return Room.MADE

    def relieve(
        self,
        excess: int,
        reductions: ReductionsInFlight = NO_REDUCTIONS,
        *,
        drained: bool = False,
    ) -> Room:
        """The device passed the budget by `excess` bytes after an allocation: evict shards,
        then optimizer sides, until it is back within or nothing is left to move. Where
        finishing the reductions in flight is worth it, answer `Room.AFTER_REDUCTIONS` first
        (`drained`: the caller has just finished them, and `excess` is what is left)."""
        if not drained:
            self.overruns += 1
            if self._draining_helps(excess, 0, reductions):
                return Room.AFTER_REDUCTIONS
        evictions = self.evictions
        position = max(self._position - 1, 0)
        while excess > 0:
            victim = self._victim(set(), position)
            if victim is None:
                break
            excess -= self._move(victim, lambda c: c.move_payload(Pool.HOST))
        for chunk in reversed(self.chunk_manager.chunks):
            if excess <= 0:
                break
            if chunk.requires_grad and chunk.placement.optim is Pool.DEVICE:
                excess -= self._move(chunk, self.evict_optim)
        if self.evictions > evictions:
            # The plan kept on the device what this step needed room for: plan again after
            # the step, and make room before each gather until then. (An overrun that only
            # waited for reductions, or had nothing to move, changes no plan.)
            self.overruns_since_plan += 1
            self.plan_holds = False
        return Room.MADE

    def _pause(self, resume: Callable[[], Room]) -> Room:
        self._paused = resume
        return Room.AFTER_REDUCTIONS

    def resume(self) -> Room:
        """Finish the decision that answered `Room.AFTER_REDUCTIONS`, now that the caller has
        finished the reductions in flight."""
        paused, self._paused = self._paused, None
        assert paused is not None, "nothing was paused for the reductions in flight"
        return paused()

    def _gathered_bytes(self, chunk: Chunk) -> int:
        # Asked before every gather: fixed per chunk, so counted once.
        nbytes = self._gathered.get(chunk.chunk_id)
        if nbytes is None:
            nbytes = self._gathered[chunk.chunk_id] = gathered_bytes(chunk)
        return nbytes

    def _grad_buffer_bytes(self, chunk: Chunk) -> int:
        nbytes = self._grad_buffer.get(chunk.chunk_id)
        if nbytes is None:
            nbytes = chunk.padded_numel * _reduce_size(chunk)
            self._grad_buffer[chunk.chunk_id] = nbytes
        return nbytes

    def _draining_helps(self, excess: int, need: int, reductions: ReductionsInFlight) -> bool:
        """Whether to finish the reductions in flight: when that makes the `excess` bytes of
        room, or when the model state (with `need` more bytes) passes the budget on its own.
        Otherwise the excess is activations that nothing frees: waiting would only take the
        reductions' overlap with backward away, at every gather and gradient of the step
        ("cpu" placement, which does not count activations, keeps it)."""
        in_flight = reductions.in_flight_bytes()
        if in_flight == 0:
            return False
        return excess <= in_flight or self._device_bytes() + need > self.budget

    def _move(self, chunk: Chunk, move: Callable[[Chunk], None]) -> int:
        """Move part of `chunk` to the host; the device bytes that freed."""
        before = self._chunk_device_bytes(chunk)
        move(chunk)
        self.evictions += 1
        return before - self._chunk_device_bytes(chunk)

    def observe(self, working_bytes: int) -> None:
        self.working_peak = max(self.working_peak, working_bytes)

    def _victim(self, needed: set[int], position: int) -> Chunk | None:
        candidates = [
            c
            for c in self.chunk_manager.chunks
            if c.placement.payload is Pool.DEVICE
            and not c.keep_gathered
            and c.payload.state is ChunkState.SHARDED
            and not c.payload.gather_pending
            and c.chunk_id not in needed
        ]
        if not candidates:
            return None
        if not self.warm:
            return min(candidates, key=lambda c: (self._last_use.get(c.chunk_id, -1), -c.chunk_id))
        return max(candidates, key=lambda c: (self._distance(c.chunk_id, position), c.chunk_id))

    def _distance(self, chunk_id: int, position: int) -> int:
        uses = self._uses.get(chunk_id, [])
        if not uses:
            return 1 << 62
        later = bisect.bisect_right(uses, position)
        if later < len(uses):
            return uses[later] - position
        return uses[0] + len(self.timeline) - position

    def end_warmup(
        self,
        move_optim: Callable[[Chunk], None],
        agree_max: Callable[[int], int] = lambda value: value,
    ) -> None:
        """Fix the timeline, then plan what stays on the device (see [Note: auto placement])."""
        self.warm = True
        self.tracer.stop()
        for position, ids in enumerate(self.timeline):
            for chunk_id in ids:
                self._uses.setdefault(chunk_id, []).append(position)
        self._plan(move_optim, agree_max)

    def replan(
        self,
        move_optim: Callable[[Chunk], None],
        agree_max: Callable[[int], int] = lambda value: value,
    ) -> None:
        """A step allocated more than the plan foresaw (`overruns_since_plan`: e.g. gradients
        held whole under `no_sync`): send every shard and optimizer side back to host memory
        and plan again against the largest working set seen since, as at the end of warm-up.
        Every rank calls it at the same step (the plan's agreements are collectives)."""
        for chunk in self.chunk_manager.chunks:
            if chunk.keep_gathered:
                continue
            if chunk.requires_grad and chunk.placement.optim is Pool.DEVICE:
                self.evict_optim(chunk)
            if chunk.placement.payload is Pool.DEVICE and chunk.payload.state is ChunkState.SHARDED:
                chunk.move_payload(Pool.HOST)
        self.replans += 1
        self._plan(move_optim, agree_max)

    def _plan(
        self,
        move_optim: Callable[[Chunk], None],
        agree_max: Callable[[int], int],
    ) -> None:
        self.overruns_since_plan = 0
        chunks = self.chunk_manager.chunks
        # The least the step needs on the device: its working set beside its activations,
        # the largest of every rank's (the prefetch decision must agree).
        working = agree_max(self.working_peak)
        floor = agree_max(self.working_peak + max(self.non_model, default=0))
        self.warmup_peak = floor
        largest = max((gathered_bytes(c) for c in chunks if not c.keep_gathered), default=0)
        # A prefetch is planned against the working set alone, as "cpu" placement's is:
        # activations cannot move, so leaving room for them would only turn it off there.
        self.prefetch = working + largest <= self.budget
        # Room for a prefetched chunk and one kept gathered from forward into backward, and
        # for the gradient buffer a backward prefetch brings on (the warm-up, which does not
        # prefetch, never held it: without it backward's prefetch would wait for the
        # reduction in flight to make room), reserved at every budget so that what stays on
        # the device only grows with it.
        largest_grads = max(
            (self._grad_buffer_bytes(c) for c in chunks if c.requires_grad and not c.keep_gathered),
            default=0,
        )
        self.reserved_bytes = 2 * largest + largest_grads
        room = self.budget - floor - self.reserved_bytes
        # What the wrap placed on the device takes its room; where the step measured less
        # room than the wrap kept (activations larger than its share), sides go back to host
        # memory first, the last chunks' first, then shards.
        room -= sum(_resident_device_bytes(c) for c in chunks)
        for chunk in reversed(chunks):
            if room >= 0:
                break
            if chunk.requires_grad and chunk.placement.optim is Pool.DEVICE:
                room += _side_bytes(chunk)
                self.evict_optim(chunk)
        for chunk in reversed(chunks):
            if room >= 0:
                break
            if _movable_shard(chunk):
                room += _shard_bytes(chunk)
                chunk.move_payload(Pool.HOST)
        self.plan_holds = room >= 0
        # Shards first: each saves its gathers' copies for as many bytes of device memory as
        # it takes. The most used first; a chunk no step gathers saves nothing.
        used = sorted(
            (c for c in chunks if c.chunk_id in self._uses and not c.keep_gathered),
            key=lambda c: (-len(self._uses[c.chunk_id]), c.chunk_id),
        )
        for chunk in used:
            shard_bytes = chunk.payload.shard.numel() * chunk.payload.shard.element_size()
            if chunk.placement.payload is Pool.HOST and shard_bytes <= room:
                chunk.move_payload(Pool.DEVICE)
                room -= shard_bytes
        ratio = 1.0 if self.margin_ratio is None else self.margin_ratio
        margin = int(ratio * max(0, room))
        for chunk in used:
            # A side beside a shard in host memory would only turn the updated parameters'
            # trip to the device into one to the host: no saving. (One on the disk tier stays
            # there: it was put there for want of host memory, not of device memory.)
            if not chunk.requires_grad or chunk.placement.optim is not Pool.HOST:
                continue
            if chunk.placement.payload is Pool.HOST:
                continue
            side = _side_bytes(chunk)
            if side <= margin:
                margin -= side
                move_optim(chunk)
        # Chunks no step gathered (an unused branch) still have their gradients reduced, and
        # moved to the host unless their whole state is on the device: last, if room is left.
        for chunk in chunks:
            if chunk.chunk_id in self._uses or chunk.keep_gathered or not chunk.requires_grad:
                continue
            if chunk.placement.optim is not Pool.HOST:
                continue
            shard_bytes = chunk.payload.shard.numel() * chunk.payload.shard.element_size()
            side = _side_bytes(chunk)
            if shard_bytes + side <= margin:
                margin -= shard_bytes + side
                chunk.move_payload(Pool.DEVICE)
                move_optim(chunk)


def _movable_shard(chunk: Chunk) -> bool:
    return (
        not chunk.keep_gathered
        and chunk.placement.payload is Pool.DEVICE
        and chunk.payload.state is ChunkState.SHARDED
    )


def _shard_bytes(chunk: Chunk) -> int:
    return chunk.payload.shard.numel() * chunk.payload.shard.element_size()


def _resident_device_bytes(chunk: Chunk) -> int:
    """Device bytes of `chunk`'s model state that stay there between steps: its shard (a
    sharded chunk's, on the device) and its optimizer side (on the device)."""
    held = _shard_bytes(chunk) if _movable_shard(chunk) else 0
    if chunk.requires_grad and chunk.placement.optim is Pool.DEVICE:
        held += _side_bytes(chunk)
    return held


def _side_bytes(chunk: Chunk) -> int:
    """Device bytes `chunk`'s optimizer side takes there beside its shard: the fp32 master
    (none when the shard is fp32), the gradient shard, and the optimizer's state (Adam's two
    moments when it has none yet)."""
    grad = chunk.grads.shard.numel() * chunk.grads.shard.element_size()
    begin, end = chunk.shard_begin, chunk.shard_begin + chunk.shard_numel
    # The optimizer keeps state for this rank's slices of the tensors, not for the padding.
    owned = sum(
        max(0, min(end, t.offset + t.numel) - max(begin, t.offset))
        for t in chunk.tensors
        if t.param.requires_grad
    )
    # An fp32 master beside its shard on the device is the shard itself (Chunk.move_optim).
    master = 0 if chunk.dtypes.payload == torch.float32 else chunk.master.numel() * 4
    return master + grad + (chunk.optimizer_state.nbytes() or owned * 8)


def _reduce_size(chunk: Chunk) -> int:
    return chunk.grads.shard.new_empty((), dtype=chunk.dtypes.reduce).element_size()
