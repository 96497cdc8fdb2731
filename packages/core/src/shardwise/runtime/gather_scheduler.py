"""Stage 3: gather each chunk just before a gather unit that uses it runs, release it after.

[Note: recorded execution order]
The first forward and backward of a model record which chunks each gather unit's call needs
(see [Note: gather units] in runtime/unit_plan.py), in order. From then on that record drives
three things: a chunk is released in forward right after the last unit call that uses it ends
(so a tied embedding used again by the head stays gathered); the next chunk the record needs,
beyond those of the current call, is gathered asynchronously while the current units compute;
and the chunks backward starts with stay gathered from the end of a forward run with gradients
on, since backward would gather them again at once. The first pass, having no record yet,
releases a chunk once every tensor in it has been used (a tied weight is then gathered again
when reused). If a later pass departs from the record (data-dependent control flow) the rest
of that pass falls back to on-demand gathers and releases at the end of forward: slower, never
wrong. Every rank must run the same units in the same order, as with any ZeRO-3 engine, since
gathers are collectives; a block whose children run on some ranks only (experts behind a
router) is one gather unit, so its children issue none (see [Note: conditional units] in
runtime/gather_units.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from shardwise import comm
from shardwise.chunk import Chunk, ChunkManager, ChunkState, TensorState
from shardwise.chunk.parameters import ShardedParameter, on_use
from shardwise.gemini import GeminiManager, Pass, Room
from shardwise.runtime.frozen_users import FrozenUsers
from shardwise.runtime.gather_units import UnitMap
from shardwise.runtime.grad_reducer import GradReducer
from shardwise.runtime.hooks import HookSet
from shardwise.runtime.pass_trace import PassTrace
from shardwise.runtime.phase import PassState, Phase
from shardwise.runtime.rank_sync import VisitTrail
from shardwise.runtime.unit_plan import GatherUnit, compiled


class GatherScheduler:
    """Hooks on every gather unit (see [Note: gather units] in runtime/unit_plan.py): gather the
    chunks of the parameters a unit governs before it runs, register their compute faces
    while it runs, release the chunks after their last use.

    Args:
        module: the user's model.
        chunk_manager: its chunks.
        plan: the gather units of the model, given the uses outside their own units that its
            first forward found (per parameter name, the names of the units it was used in)
            and whether its repeated blocks are units (the model is compiled as a whole).
        state: the phase of the pass, which the runtime moves (see [Note: the phase of the
            pass] in runtime/phase.py).
        prefetch: gather the next chunk of the recorded order asynchronously.
        prefetch_chunks: how many chunks ahead a prefetch gathers (ColossalAI's
            `max_prefetch`); under "auto" each is made room for within the budget, as the
            first is.
        gemini: the memory manager to consult around every gather (room for the chunks,
            the budget check), if any.
        reductions: the model's gradient reductions, which the memory manager weighs and
            which are finished when it answers that room needs it (see [Note: room after the
            reductions] in gemini/room.py).
        units: the conditional blocks, whose backward signals their chunks' completion (see
            [Note: conditional units]); none when not given.
        trail: where the modules whose hooks ran are recorded, for the ranks' pass checks
            (`RankSync`); a trail of its own when not given.
        enter_backward: called from a backward pass's first reach of the schedule's hooks,
            before its first gather: the runtime moves the phase, queues the end of backward
            (which calls `end_backward`) and calls `begin_backward`.
        hooks: where the schedule's hooks are kept (see [Note: one owner of an engine's
            hooks] in runtime/hooks.py); a set of its own when not given.
    """

    def __init__(
        self,
        module: nn.Module,
        chunk_manager: ChunkManager,
        *,
        plan: Callable[[dict[str, set[str]], bool], list[GatherUnit]],
        state: PassState,
        prefetch: bool,
        prefetch_chunks: int = 1,
        gemini: GeminiManager | None = None,
        reductions: GradReducer,
        units: UnitMap | None = None,
        trail: VisitTrail | None = None,
        enter_backward: Callable[[], None],
        hooks: HookSet | None = None,
    ) -> None:
        self.chunk_manager = chunk_manager
        self._state = state
        self._enter_backward = enter_backward
        self._module = module
        self._plan = plan
        # A policy may forbid prefetching; "auto" allows it once its plan has room for it
        # (GeminiManager.prefetch_planned).
        self.prefetch = prefetch and (gemini is None or gemini.policy.allows_prefetch)
        self._prefetch_chunks = prefetch_chunks
        self._gemini = gemini
        self._reductions = reductions
        self._used_in_pass: dict[int, set[int]] = {}
        self._keep_for_backward: frozenset[int] = frozenset()
        self._hooks = hooks if hooks is not None else HookSet()
        self._unit_hooks = self._hooks.part()  # replaced with the units (`_install`)
        self.units = units if units is not None else UnitMap(module, chunk_manager, {})
        # The modules whose hooks ran since the last pass check, compared across ranks there.
        self.trail = trail if trail is not None else VisitTrail()
        # The units running now, innermost last, and how many calls of each are open.
        self._active: list[GatherUnit] = []
        self._open: dict[int, int] = {}
        # See [Note: gather units]: the first pass learns uses outside their units.
        self._learning = True
        self._learning_started = False
        self._used_in: dict[str, set[str]] = {}  # parameter name -> units it was used in
        self._pinned: set[int] = set()  # chunks gathered on use, held until the pass ends
        # Per frozen chunk, the unit calls whose backward runs now (see [Note: frozen chunks
        # in backward] in runtime/frozen_users.py).
        self._frozen = FrozenUsers(
            chunk_manager, state, lambda chunk: self._releasable(chunk, frozenset())
        )
        self._sharded_faces = [
            info.param
            for chunk in chunk_manager.chunks
            if not chunk.keep_gathered
            for info in chunk.tensors
        ]
        for submodule in module.modules():
            unit = self.units.index_of(submodule)
            if unit is not None:
                self._hooks.add(
                    submodule.register_forward_pre_hook(
                        _outside_compiled(self.units.watch_backward(unit)), with_kwargs=True
                    )
                )
        self._blocks = False
        self._install(plan({}, False))

    def _install(self, gather_units: list[GatherUnit]) -> None:
        """Hook `gather_units`, recording the passes afresh."""
        self._unit_hooks.remove()
        self.gather_units = gather_units
        self._forward = PassTrace(self._prefetch_chunks)
        self._backward = PassTrace(self._prefetch_chunks)
        self._recorded_closes: list[tuple[int, ...]] = []
        self._last_close: dict[int, int] = {}
        self._closes = 0
        self._root_unit: tuple[Callable[..., None], Callable[..., None]] | None = None
        for unit in gather_units:
            visit = self.trail.register(unit.name or type(unit.module).__name__)
            pre, post = self._pre_forward(unit, visit), self._post_forward(unit, visit)
            if unit.module is self._module:
                # The model's own root hooks call these, inside their bookkeeping of the pass
                # (see root_pre_forward).
                self._root_unit = (pre, post)
                continue
            self._unit_hooks.add(unit.module.register_forward_pre_hook(pre, with_kwargs=True))
            self._unit_hooks.add(unit.module.register_forward_hook(post))

    def root_pre_forward(self) -> None:
        """The model's root unit, if it is one, is about to run: the model's root pre-hook
        calls this after `begin_forward`, so it gathers inside the pass it begins."""
        if self._root_unit is not None:
            self._root_unit[0](self._module, (), {})

    def root_post_forward(self, output: Any) -> None:
        """The model's root unit, if it is one, has run: the model's root post-hook calls this
        before `end_forward`, whatever hooks were registered on the root since."""
        if self._root_unit is not None and self._active and self._active[-1].module is self._module:
            self._root_unit[1](self._module, (), output)

    # ---- forward -----------------------------------------------------------------------------

    def begin_forward(self) -> None:
        if self._learning and not self._learning_started:
            self._learning_started = True
            # Planned again at the first forward: blocks compiled after wrapping are units.
            self._install(self._plan(self._used_in, self._blocks))
            for param in self._sharded_faces:
                on_use(param, self._gather_on_use)
        elif self._learning:
            self._finish_learning()  # the first forward had no backward
        self._forward.begin()
        self._closes = 0
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
        self._close_open_units()
        if not self._forward.recorded:
            self._forward.finish()
            self._last_close = {
                chunk_id: position
                for position, chunk_ids in enumerate(self._recorded_closes)
                for chunk_id in chunk_ids
            }
        grad = torch.is_grad_enabled()
        if self._learning and not grad:
            self._finish_learning()
        keep = self._keep_for_backward if self._forward.on_track else frozenset()
        if grad:
            keep |= self._pinned  # see [Note: gather units]: held until backward ends
        self.release_all(keep=keep, keep_secondary=grad)

    def _needed_first_by_backward(self) -> frozenset[int]:
        # Backward starts with the modules forward ended with: releasing their chunks only to
        # gather them again at once would cost an all-gather nothing can hide. Kept only when
        # a backward can follow (gradients are on) and the pass follows the record; under
        # "auto" only once its plan has room for the prefetch too.
        if not self._prefetching() or not self._backward.recorded or not torch.is_grad_enabled():
            return frozenset()
        return frozenset(self._backward.steps[0])

    def _pre_forward(self, unit: GatherUnit, visit: int) -> Any:
        places = unit.places
        chunks = _unique_chunks(places)
        chunk_ids = tuple(chunk.chunk_id for chunk in chunks)
        key = id(unit)
        is_compiled = compiled(unit.module)

        @_outside_compiled
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            trace = self._backward if self._serving is Pass.BACKWARD else self._forward
            trace.visit(chunk_ids)
            self.trail.add(visit)
            self._gather(chunks, self._serving, f"before forward of {type(module).__name__}")
            for chunk, index in places:
                chunk.set_compute(index)
            if self._open.get(key, 0) == 0:
                unit.swap_in()
            self._open[key] = self._open.get(key, 0) + 1
            self._active.append(unit)
            self._prefetch(trace)
            if self._learning:
                # A parameter handed in from outside (the unit may be compiled, and would
                # trace it sharded): used here, see [Note: gather units] in runtime/unit_plan.py.
                return tree_map(self._face_if_sharded, (args, kwargs))
            if is_compiled:
                _refuse_sharded_arguments(unit, (args, kwargs))
            return None

        return hook

    def _face_if_sharded(self, value: Any) -> Any:
        if isinstance(value, ShardedParameter) and value._on_use is not None:
            return value._on_use(value)
        return value

    def _gather(self, chunks: list[Chunk], serving: Pass, where: str) -> None:
        """Gather `chunks`, consulting the memory manager only when one is actually sharded
        (nothing grows otherwise: this runs for every unit call)."""
        sharded = [chunk for chunk in chunks if chunk.payload.state is ChunkState.SHARDED]
        if not sharded:
            return
        if self._gemini is not None:
            self._settle(self._gemini.before_gather(sharded, serving, self._reductions))
        for chunk in sharded:
            chunk.payload.gather()
        if self._gemini is not None:
            self._settle(self._gemini.after_gather(sharded, where, self._reductions))

    def _settle(self, room: Room) -> None:
        """See [Note: room after the reductions] in gemini/room.py."""
        if room is Room.AFTER_REDUCTIONS:
            assert self._gemini is not None
            self._reductions.finish_in_flight()
            self._gemini.resume()

    def _post_forward(self, unit: GatherUnit, visit: int) -> Any:
        places = unit.places
        chunks = _unique_chunks(places)
        chunk_ids = tuple(chunk.chunk_id for chunk in chunks)
        frozen = [c for c in chunks if not c.requires_grad and not c.keep_gathered]

        @_outside_compiled
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._close(unit)
            for chunk, index in places:
                chunk.set_hold(index)
            if self._serving is not Pass.BACKWARD:
                close = self._closes
                self._closes += 1
                if not self._forward.recorded:
                    self._recorded_closes.append(chunk_ids)
                    self._release_fully_used(places)
                elif self._forward.on_track:
                    for chunk in chunks:
                        if self._last_close.get(chunk.chunk_id) == close and self._releasable(
                            chunk, self._keep_for_backward
                        ):
                            chunk.payload.release(keep_secondary=torch.is_grad_enabled())
            if torch.is_grad_enabled():
                self._register_pre_backward(output, chunks, visit)
                if frozen:
                    self._frozen.watch(args, output, frozen)

        return hook

    def _close(self, unit: GatherUnit) -> None:
        """One call of `unit` ended: its sharded faces are registered again once no call of it
        is open (a unit may run inside itself, through recursion)."""
        key = id(unit)
        self._open[key] -= 1
        if self._open[key] == 0:
            unit.swap_out()
        if self._active and self._active[-1] is unit:
            self._active.pop()

    def _close_open_units(self) -> None:
        # A forward that raised left units open: their sharded faces are registered again.
        for unit in self._active:
            unit.swap_out()
        self._active.clear()
        self._open.clear()

    def _releasable(self, chunk: Chunk, keep: frozenset[int]) -> bool:
        return (
            chunk.chunk_id not in keep
            and chunk.chunk_id not in self._pinned
            and not chunk.in_use
            and not chunk.keep_gathered
        )

    def _release_fully_used(self, places: list[tuple[Chunk, int]]) -> None:
        """First pass: release a chunk once each of its tensors has been used."""
        for chunk, index in places:
            self._used_in_pass.setdefault(chunk.chunk_id, set()).add(index)
        for chunk in _unique_chunks(places):
            used = len(self._used_in_pass[chunk.chunk_id])
            if used == len(chunk.tensors) and self._releasable(chunk, frozenset()):
                chunk.payload.release(keep_secondary=torch.is_grad_enabled())

    # ---- learning the units --------------------------------------------------------------------

    def _gather_on_use(self, param: nn.Parameter) -> nn.Parameter:
        """A sharded face used outside its unit in the first forward: gather its chunk, hold
        it until the pass ends, note the unit it was used in (the innermost running; the
        model's own forward outside every unit counts as the model's), and hand back the
        compute face (see [Note: gather units])."""
        chunk, index = self.chunk_manager.locate(param)
        self._gather([chunk], self._serving, f"on use of {chunk.tensors[index].name}")
        self._pinned.add(chunk.chunk_id)
        user = self._active[-1].name if self._active else ""
        self._used_in.setdefault(chunk.tensors[index].name, set()).add(user)
        return chunk.tensors[index].compute

    def _finish_learning(self) -> None:
        """The first pass is over: no more gathers on use; if some parameter was used outside
        its unit, plan the units again with it moved (the passes are recorded afresh)."""
        self._learning = False
        for param in self._sharded_faces:
            on_use(param, None)
        # Every rank plans alike: a use on some ranks only (a branch) counts everywhere.
        manager = self.chunk_manager
        everyone = comm.all_gather_object(
            self._used_in, manager.stats, manager.topology.data_parallel
        )
        for used_in in everyone:
            for name, units in used_in.items():
                self._used_in.setdefault(name, set()).update(units)
        if self._used_in:
            self._install(self._plan(self._used_in, self._blocks))

    def compiled_as_a_whole(self) -> None:
        """The model runs compiled as a whole: its repeated blocks become units (rule 3 of
        [Note: gather units]), so the compiled graph breaks at blocks. Between passes only."""
        if not self._blocks:
            self._blocks = True
            self._install(self._plan(self._used_in, True))

    # ---- backward ----------------------------------------------------------------------------

    def _register_pre_backward(self, output: Any, chunks: list[Chunk], visit: int) -> None:
        chunk_ids = tuple(chunk.chunk_id for chunk in chunks)
        # The hook lives in the autograd graph, which the user may keep (the last loss): it
        # holds the schedule weakly and its chunks by id (see [Note: hooks hold the engine
        # weakly] in runtime/grad_reducer.py).
        schedule = weakref.ref(self)

        def hook(grad: torch.Tensor) -> None:
            owner = schedule()
            if owner is not None:  # else the engine is gone and the graph outlived it
                owner._pre_backward(chunk_ids, visit)

        leaves, _ = tree_flatten(output)
        for tensor in leaves:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(hook)

    def _pre_backward(self, chunk_ids: tuple[int, ...], visit: int) -> None:
        self._enter_backward()
        self._backward.visit(chunk_ids)
        self.trail.add(visit)
        self._gather(self._chunks_of(chunk_ids), Pass.BACKWARD, "before backward")
        self._prefetch(self._backward)

    def _chunks_of(self, chunk_ids: tuple[int, ...]) -> list[Chunk]:
        chunks = self.chunk_manager.chunks
        return [chunks[chunk_id] for chunk_id in chunk_ids]

    @property
    def _serving(self) -> Pass:
        """The pass the gathers serve now."""
        return Pass.BACKWARD if self._state.phase is Phase.PRE_BACKWARD else Pass.FORWARD

    def begin_backward(self) -> None:
        """A backward pass starts (the runtime calls this before its first gather)."""
        self._backward.begin()

    def end_backward(self, *, completed: bool = True) -> None:
        """Autograd finished a backward pass (see [Note: one end of backward] in
        runtime/backward_end.py): release what is still gathered, settle the recorded order.
        A pass that raised midway (`completed` False) leaves no record: the next backward
        records afresh where none was recorded yet, and the first pass's lessons wait for the
        next forward (see [Note: the phase of the pass] in runtime/phase.py). Local."""
        self.units.end_backward()
        if completed:
            self._backward.finish()
        elif not self._backward.recorded:
            self._backward = PassTrace(self._prefetch_chunks)
        # Nothing computes once backward has ended. A module's re-run forward under
        # non-reentrant checkpointing stops as soon as it has recomputed what backward needs,
        # which may be before the module's own forward hook marks its tensors done.
        for chunk in self.chunk_manager.chunks:
            for index, info in enumerate(chunk.tensors):
                if info.state is TensorState.COMPUTE:
                    chunk.set_hold(index)
        self._close_open_units()
        self._pinned.clear()
        self._frozen.clear()
        self.release_all()
        if self._learning and completed:
            self._finish_learning()
        if self.chunk_manager.topology.secondary is not None:  # hpZ
            for chunk in self.chunk_manager.chunks:
                chunk.payload.drop_secondary()  # what backward did not gather (an unused branch)

    # ---- shared ------------------------------------------------------------------------------

    def _prefetching(self) -> bool:
        # Every rank decides alike: a prefetch is a collective.
        return self.prefetch and (self._gemini is None or self._gemini.prefetch_planned)

    def _prefetch(self, trace: PassTrace) -> None:
        if not self._prefetching():
            return
        for chunk_id in trace.upcoming():
            chunk = self.chunk_manager.chunks[chunk_id]
            if chunk.payload.state is ChunkState.SHARDED and not chunk.payload.gather_pending:
                if self._gemini is not None:
                    self._settle(
                        self._gemini.before_prefetch([chunk], self._serving, self._reductions)
                    )
                chunk.payload.start_gather()
                if self._gemini is not None:
                    where = f"after prefetching chunk {chunk_id}"
                    self._settle(self._gemini.check_budget(where, self._reductions))

    def release_all(
        self, keep: frozenset[int] = frozenset(), *, keep_secondary: bool = False
    ) -> None:
        """Release every gathered (or prefetching) chunk not in use, but those in `keep`;
        with `keep_secondary`, each keeps its secondary copy for backward (hpZ)."""
        for chunk in self.chunk_manager.chunks:
            if (
                (chunk.payload.state is ChunkState.GATHERED or chunk.payload.gather_pending)
                and chunk.chunk_id not in keep
                and not chunk.in_use
                and not chunk.keep_gathered
            ):
                chunk.payload.release(keep_secondary=keep_secondary)

    def remove(self) -> None:
        self._hooks.remove()


def _refuse_sharded_arguments(unit: GatherUnit, arguments: Any) -> None:
    """A compiled unit handed a parameter sharded outside its own unit, which the first pass
    never saw handed in (a branch not taken then): dynamo would trace a tensor holding no
    element. Say which, and what to do, instead."""
    for value in tree_flatten(arguments)[0]:
        if isinstance(value, ShardedParameter):
            raise ValueError(
                f"{value._chunk_name} (shape {tuple(value._logical_shape)}) is handed to the "
                f"compiled module {unit.name or 'the model'!r} from outside the gather unit "
                f"that holds it, which the model's first forward did not do: its values are "
                f"sharded there. Name a module holding both in gemini_config['gather_units'] "
                f"(it is then gathered as one), or run that path in the first forward"
            )


def _outside_compiled(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook`, run eagerly even where it is called inside a region `torch.compile` traces:
    gathers are collectives, and registering faces changes what the region reads (a graph
    break at each unit; see [Note: gather units] in runtime/unit_plan.py)."""
    return torch._dynamo.disable(hook, recursive=True)  # type: ignore[no-any-return]


def _unique_chunks(places: list[tuple[Chunk, int]]) -> list[Chunk]:
    seen: dict[int, Chunk] = {}
    for chunk, _ in places:
        seen.setdefault(chunk.chunk_id, chunk)
    return list(seen.values())
