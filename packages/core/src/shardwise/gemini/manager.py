"""Where chunks live: a placement policy over a chunk manager, checked against a memory budget.

[Note: placement policies]
- "cuda" (alias "device"): every buffer on the compute device. The fastest, and the right
  policy on a CPU host, where the device *is* host memory.
- "cpu": the shards of sharded chunks and the whole optimizer side (fp32 master, fp32
  gradient shard, optimizer state) in host memory; a chunk's payload comes to the device only
  to be gathered for the modules that use it, and the optimizer steps on the host.
- "static": fractions, each applied to chunks in chunk order: the first ceil(shard_param_frac
  x n) chunks are sharded (the rest stay gathered, as in stage 2); of the sharded chunks the
  first floor(offload_param_frac x n) keep their shard in host memory; of the trainable chunks
  the first floor(offload_optim_frac x n) keep their optimizer side in host memory. (Through
  the Gemini arguments, as in ColossalAI, offload_param_frac counts only when shard_param_frac
  and offload_optim_frac are both 1.0: see placement_policy in gemini/policies.py.)
Every choice depends only on chunk order, so every rank and every run decides alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from shardwise import comm
from shardwise.chunk import Chunk, ChunkManager, Pool
from shardwise.chunk.accounting import disk_bytes, resident_bytes_by_pool
from shardwise.chunk.manager import PlannedChunk, place_packed
from shardwise.gemini.auto_placement import AutoPlacer
from shardwise.gemini.collaborators import NO_REDUCTIONS, ReductionsInFlight
from shardwise.gemini.device_tally import DeviceTally
from shardwise.gemini.errors import DeviceBudgetExceeded
from shardwise.gemini.passes import Pass
from shardwise.gemini.policies import (
    AutoPlacement,
    DevicePlacement,
    HostPlacement,
    PlacementPolicy,
)
from shardwise.gemini.policies import placement_policy as placement_policy_object
from shardwise.gemini.room import Room
from shardwise.gemini.tracer import MemoryTracer
from shardwise.gemini.working_set import WorkingSetGuard
from shardwise.gemini.wrap_plan import WrapPlan

_log = logging.getLogger(__name__)


class GeminiManager:
    """Decides where each chunk's payload and optimizer side live, and accounts every byte.

    Args:
        placement_policy: "cuda" / "device", "cpu", "static" (see [Note: placement policies])
            or "auto" (see [Note: auto placement]), or a `PlacementPolicy` object.
        chunk_manager: the (still empty) chunks to place.
        device_budget_bytes: the most bytes of model state the compute device may hold at any
            point of a step; checked after every gather and gradient copy. None: unlimited
            (default; on CUDA, the device's capacity less 10%).
        shard_param_frac, offload_optim_frac, offload_param_frac: the "static" policy's
            fractions, each in [0, 1].
        gpu_margin_mem_ratio: the "auto" policy's share, in [0, 1], of the device room left
            after warm-up that optimizer sides may use (0.0: none, as the seeds define it);
            None (the default): all of it, as the plan decides (see [Note: auto placement]).
    """

    def __init__(
        self,
        placement_policy: str | PlacementPolicy,
        chunk_manager: ChunkManager,
        *,
        device_budget_bytes: int | None = None,
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        gpu_margin_mem_ratio: float | None = None,
    ) -> None:
        if isinstance(placement_policy, PlacementPolicy):
            if (shard_param_frac, offload_optim_frac, offload_param_frac) != (1.0, 0.0, 0.0) or (
                gpu_margin_mem_ratio is not None
            ):
                raise ValueError(
                    "a PlacementPolicy object carries its own fractions; leave shard_param_frac, "
                    "offload_optim_frac, offload_param_frac and gpu_margin_mem_ratio unset"
                )
            self.policy = placement_policy
        else:
            self.policy = placement_policy_object(
                placement_policy,
                shard_param_frac=shard_param_frac,
                offload_optim_frac=offload_optim_frac,
                offload_param_frac=offload_param_frac,
                gpu_margin_mem_ratio=gpu_margin_mem_ratio,
            )
        if not isinstance(chunk_manager, ChunkManager):
            raise TypeError(
                f"chunk_manager must be a ChunkManager, got {type(chunk_manager).__name__}"
            )
        self.placement_policy = self.policy.name
        self.chunk_manager = chunk_manager
        self.device_budget_bytes = device_budget(
            self.policy, device_budget_bytes, chunk_manager.device
        )
        self.peak_device_bytes = 0
        # Model state alone, which the budget bounds ("auto" may pass it only by activations
        # it could not make room for: those cannot move to the host).
        self.peak_model_device_bytes = 0
        # See [Note: device tally].
        self.tally = DeviceTally(chunk_manager)
        # A decision paused for the reductions in flight (see [Note: room after the
        # reductions] in room.py).
        self._paused: Callable[[], Room] | None = None
        # See [Note: the working set and the budget] in gemini/working_set.py.
        self.working_set: WorkingSetGuard | None = None
        if self.device_budget_bytes is not None and isinstance(
            self.policy, (AutoPlacement, HostPlacement)
        ):
            self.working_set = WorkingSetGuard(
                chunk_manager, self.device_budget_bytes, self.policy.name
            )
        # The pools of each chunk of the packing being placed (see `plan_placement`).
        self._pools_of: Callable[[Chunk], tuple[Pool, Pool]] | None = None
        self.auto: AutoPlacer | None = None
        if isinstance(self.policy, AutoPlacement):
            assert self.device_budget_bytes is not None
            tracer = MemoryTracer(chunk_manager.device, self.tally.device_bytes)
            self.auto = AutoPlacer(
                chunk_manager,
                budget=self.device_budget_bytes,
                margin_ratio=self.policy.margin_ratio,
                device_bytes=self.tally.device_bytes,
                chunk_device_bytes=self.tally.chunk_device_bytes,
                tracer=tracer,
                evict_optim=self._move_optim_to_host,
            )

    @property
    def sharded_fraction(self) -> float:
        return self.policy.sharded_fraction

    def place_chunks(self) -> None:
        """Apply the policy to chunks packed without a placer (see [Note: placement
        policies]); their host buffers come from the chunk manager's memory (pinned there
        where asked). A packing that passes this manager as its `placer` places each chunk as
        it closes instead (see [Note: placed as each chunk closes] in chunk/manager.py)."""
        place_packed(self.chunk_manager.chunks, self)

    def plan_placement(self, planned: list[PlannedChunk]) -> None:
        """Plan where the chunks of a packing go, before any of them is packed."""
        if self.auto is not None:  # see [Note: auto places from the wrap] in wrap_plan.py
            assert isinstance(self.policy, AutoPlacement)
            wrap_plan = WrapPlan(
                planned,
                self.auto.budget,
                self.auto.margin_ratio,
                activation_bytes=self.policy.activation_bytes,
            )
            self._pools_of = wrap_plan.pools
        else:
            # The policies decide by chunk order and kind alone, known before packing.
            host_payload, host_optim = self.policy.host_chunks([p.chunk for p in planned])

            def pools(chunk: Chunk) -> tuple[Pool, Pool]:
                return (
                    Pool.HOST if id(chunk) in host_payload else Pool.DEVICE,
                    Pool.HOST if id(chunk) in host_optim else Pool.DEVICE,
                )

            self._pools_of = pools

    def place_closed(self, chunk: Chunk) -> None:
        """Put a chunk that has just closed where the plan says."""
        if self._pools_of is None:
            raise RuntimeError("place_closed() before plan_placement()")
        payload, optim = self._pools_of(chunk)
        chunk.place(payload=payload, optim=optim)

    @property
    def prefetch_planned(self) -> bool:
        """Whether the schedule may gather the next chunk ahead: always, but under "auto"
        only once its plan has room for it (see [Note: auto placement]), and under "cpu"
        with a budget only once the warm-up showed room for it beside the working set."""
        if self.auto is not None:
            return self.auto.warm and self.auto.prefetch
        return self.working_set is None or self.working_set.prefetch_fits

    # Each call that may need room passes the model's gradient `reductions` ("auto" counts
    # what they hold and what the next one's start frees) and answers with a `Room`; on
    # `Room.AFTER_REDUCTIONS` the caller finishes the reductions in flight and calls
    # `resume()` (see [Note: room after the reductions] in room.py).

    def before_prefetch(
        self, chunks: list[Chunk], serving: Pass, reductions: ReductionsInFlight = NO_REDUCTIONS
    ) -> Room:
        if self.auto is None:
            return Room.MADE
        # Room for the gather alone: a chunk prefetched in backward gets its gradient buffer
        # only when the module before it has run backward, by which time the reduction in
        # flight has usually finished; the budget check at that gradient waits for it only if
        # it has not. Counting the buffer here would wait for the reduction at every backward
        # prefetch, and serialise them, where "cpu" placement keeps them overlapped in the
        # same memory.
        return self._paused_by(
            self.auto.make_room(chunks, with_grads=False, reductions=reductions), self.auto.resume
        )

    def resume(self) -> None:
        """Finish the decision that answered `Room.AFTER_REDUCTIONS`, once the caller has
        finished the gradient reductions in flight."""
        paused, self._paused = self._paused, None
        if paused is None:
            raise RuntimeError("resume() without a decision paused for the reductions in flight")
        room = paused()
        assert room is Room.MADE, "a resumed decision asked for the reductions again"

    def _paused_by(self, room: Room, resume: Callable[[], Room]) -> Room:
        if room is Room.AFTER_REDUCTIONS:
            self._paused = resume
        return room

    # ---- calls from the gather schedule (stage 3) --------------------------------------------

    def begin_forward(self) -> None:
        if self.auto is not None:
            self.auto.begin_step()
            if not self.auto.warm:
                self.auto.tracer.start()

    def end_forward(self) -> None:
        if self.auto is not None:
            self.auto.tracer.stop()

    def before_gather(
        self, chunks: list[Chunk], serving: Pass, reductions: ReductionsInFlight = NO_REDUCTIONS
    ) -> Room:
        if self.auto is None:
            return Room.MADE
        return self._paused_by(
            self.auto.before_gather(chunks, serving, reductions), self.auto.resume
        )

    def after_gather(
        self, chunks: list[Chunk], where: str, reductions: ReductionsInFlight = NO_REDUCTIONS
    ) -> Room:
        return self.check_budget(where, reductions)

    def end_of_warmup(self) -> None:
        """After the first backward: a working set over the budget raises on every rank (see
        [Note: the working set and the budget]); the "auto" policy fixes its timeline and may
        move optimizer sides to the device."""
        if self.working_set is not None and not self.working_set.warm:
            self.working_set.end_warmup(self._agree_max, self._model_state_bytes())
        if self.auto is not None and not self.auto.warm:
            self.auto.end_warmup(self._move_optim_to_device, self._agree_max)

    def restart_warmup(self) -> None:
        """The first backward raised midway (see [Note: the phase of the pass] in
        runtime/phase.py): "auto" records its timeline afresh in the next step."""
        if self.auto is not None and not self.auto.warm:
            self.auto.restart_warmup()

    @property
    def overran_since_plan(self) -> bool:
        """Under "auto": a step allocated more than the plan foresaw since it was made."""
        return self.auto is not None and self.auto.warm and self.auto.overruns_since_plan > 0

    def replan(self) -> None:
        """Under "auto", plan again what stays on the device (see AutoPlacer.replan). A
        collective: call it on every rank alike, at the end of a step some rank overran."""
        if self.auto is not None and self.auto.warm:
            self.auto.replan(self._move_optim_to_device, self._agree_max)

    def _agree_max(self, value: int) -> int:
        # Over every rank: the decision orders collectives, which must agree across shard
        # groups too under hybrid sharding.
        group = self.chunk_manager.topology.data_parallel
        values = comm.all_gather_object(value, self.chunk_manager.stats, group)
        return max(int(v) for v in values)

    @staticmethod
    def _move_optim_to_device(chunk: Chunk) -> None:
        chunk.move_optim(Pool.DEVICE)

    @staticmethod
    def _move_optim_to_host(chunk: Chunk) -> None:
        chunk.move_optim(Pool.HOST)

    def memory_by_pool(self) -> dict[str, int]:
        """Bytes of model state (payloads, masters, gradients, optimizer state) per pool now:
        "device", "host", and "disk" (the disk tier's current copies)."""
        held = {Pool.DEVICE: 0, Pool.HOST: 0, Pool.DISK: 0}
        for chunk in self.chunk_manager.chunks:
            for pool, nbytes in resident_bytes_by_pool(chunk).items():
                held[pool] += nbytes
            held[chunk.placement.optim_memory] += chunk.optimizer_state.nbytes()
            held[Pool.DISK] += disk_bytes(chunk)
        return {pool.value: nbytes for pool, nbytes in held.items()}

    def check_budget(self, where: str, reductions: ReductionsInFlight = NO_REDUCTIONS) -> Room:
        """Record the device's bytes (model state, and under "auto" the traced non-model
        memory too); raise if the model state passes the budget. "auto" first makes room
        (see [Note: auto placement]) and raises only where nothing is left to move."""
        return self._check_budget(where, reductions, drained=False)

    def _check_budget(self, where: str, reductions: ReductionsInFlight, *, drained: bool) -> Room:
        device = self.tally.device_bytes()
        self.peak_model_device_bytes = max(self.peak_model_device_bytes, device)
        if self.auto is not None:
            self.auto.observe(self.tally.transient_bytes())
            non_model = self.auto.non_model_now()
            excess = device + non_model - self.auto.budget
            if excess > 0:
                if self.auto.relieve(excess, reductions, drained=drained) is Room.AFTER_REDUCTIONS:
                    return self._paused_by(
                        Room.AFTER_REDUCTIONS,
                        partial(self._check_budget, where, reductions, drained=True),
                    )
                device = self.tally.device_bytes()
            self.peak_model_device_bytes = max(self.peak_model_device_bytes, device)
            self.peak_device_bytes = max(self.peak_device_bytes, device + non_model)
        else:
            self.peak_device_bytes = max(self.peak_device_bytes, device)
        if self.working_set is not None:
            self.working_set.observe(self.tally.transient_bytes(), where)
        if self.device_budget_bytes is not None and device > self.device_budget_bytes:
            short = device - self.device_budget_bytes
            if self.working_set is not None:
                # Everything movable is in host memory: the working set alone passes.
                self.working_set.over_budget(device, where, self._model_state_bytes())
                return Room.MADE
            raise DeviceBudgetExceeded(
                f"{where}: the device would hold {device} bytes of model state, over its budget "
                f"of {self.device_budget_bytes} by {short}; use placement_policy='cpu', raise "
                f"the static offload fractions, use smaller chunks, or raise device_budget_bytes"
            )
        return Room.MADE

    def _model_state_bytes(self) -> int:
        """Bytes of model state in memory (device and host; the disk tier's files aside)."""
        pools = self.memory_by_pool()
        return pools["device"] + pools["host"]

    def bytes_moved(self) -> dict[str, int]:
        """Bytes copied host->device and device->host, and written to and read from the disk
        tier, since the chunks were placed."""
        chunks = self.chunk_manager.chunks
        return {
            "to_device": sum(c.placement.bytes_to_device for c in chunks),
            "to_host": sum(c.placement.bytes_to_host for c in chunks),
            "to_disk": sum(c.placement.bytes_to_disk for c in chunks),
            "from_disk": sum(c.placement.bytes_from_disk for c in chunks),
        }

    def placement_report(self) -> list[dict[str, Any]]:
        """Per chunk: id, elements, state, whether sharded, and the pool of each payload."""
        return self.chunk_manager.report()

    def __repr__(self) -> str:
        return f"GeminiManager(placement_policy={self.placement_policy!r}, {self.chunk_manager!r})"


def device_budget(
    policy: PlacementPolicy, device_budget_bytes: int | None, device: torch.device
) -> int | None:
    """The budget `policy` decides against on `device`: `device_budget_bytes` when given, else
    the device's capacity less 10% on CUDA, else none; refused when the policy needs one."""
    if device_budget_bytes is not None and (
        isinstance(device_budget_bytes, bool)
        or not isinstance(device_budget_bytes, int)
        or device_budget_bytes < 1
    ):
        raise ValueError(f"device_budget_bytes must be a positive int, got {device_budget_bytes!r}")
    budget = device_budget_bytes or _default_budget(device)
    if policy.needs_budget and budget is None:
        raise ValueError(
            f"placement_policy={policy.name!r} needs a device budget: pass device_budget_bytes "
            f"(on CUDA it defaults to the device's capacity less 10%)"
        )
    return budget


# [Note: "auto" without a budget]
# "auto" moves chunks between the compute device and host memory under a device budget. On
# CUDA the budget defaults to the device's capacity; a device without one to read (a CPU host)
# has no budget unless one is given, and there both pools are host memory anyway, so keeping
# every chunk where it computes ("cuda", alias "device") is the fastest choice and the only one
# that makes sense. The front ends that default to "auto" (GeminiPlugin, Lightning's
# GeminiStrategy) resolve it through `placement_on`, so their defaults work on every host.


def placement_on(
    policy: PlacementPolicy, device: torch.device, device_budget_bytes: int | None
) -> PlacementPolicy:
    """The policy that runs on `device`: "auto" with no `device_budget_bytes`, on a device
    without a capacity to default a budget from (anything but CUDA), is "cuda" (every chunk on
    the compute device; see [Note: "auto" without a budget]); any other policy is `policy`.

    Args:
        policy: the policy asked for.
        device: the compute device the chunks will live on.
        device_budget_bytes: the budget given for "auto" (None: none given).
    """
    if (
        policy.needs_budget
        and device_budget_bytes is None
        and device.type != "cuda"  # CUDA defaults one, see _default_budget
    ):
        _log.info("placement_policy=%r on %s keeps every chunk there", policy.name, device)
        return DevicePlacement()
    return policy


def _default_budget(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    return None
