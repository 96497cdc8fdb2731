"""A chunk: one flat buffer holding many parameters, sharded evenly over the ranks.

A chunk is its tensors and the shard's geometry, with four parts, each an object with state
of its own: the payload (`chunk.payload`, payload.py: the values, gathered or sharded), the
gradient side (`chunk.grads`, grads.py), the placement (`chunk.placement`, placement.py:
the pools) and the wire (`chunk.wire`, wire/: how its values and gradients cross ranks).
The chunk itself keeps the fp32 master, packs the parameters (`close`), moves its buffers
between pools, and writes checkpoint ranges.

[Note: chunk buffers]
- `payload.full`: the whole payload (numel padded to a multiple of the world size).
  Parameters (their compute faces, in a sharded chunk: see [Note: two faces of a stage-3
  parameter] in chunk/parameters.py) are views into the *compute* buffer (`full` itself, or
  `full_compute` when the compute dtype differs from the payload dtype, filled by the wire's
  gather side: see [Note: wire formats] in chunk/wire/formats.py), made once. Releasing resizes the
  buffer's storage to zero instead of dropping it, and a gather refills it, so those views,
  and the ones autograd saved during forward (a transposed weight, say), see the re-gathered
  data in backward (the same trick torch's FSDP uses).
- `payload.shard`: this rank's slice of the payload, always resident (a view into `full` when
  the chunk keeps its payload gathered, as in stages 1 and 2).
- `master`: fp32 copy of the shard for the optimizer; the same tensor as the shard when the
  payload is already fp32, so fp32 training keeps no second copy.
- `payload.secondary` (ZeRO++ hpZ, stage 3 with `secondary_shard_size`): this rank's slice of the
  payload within its secondary group, in the form the wire sends (the payload dtype, or the
  records of a quantized gather), kept from a forward's release for the next gather (see
  [Note: secondary shards]); None otherwise.
- `grads` (grads.py), the gradient side, an object of its own: `grads.full`, gradients of the
  whole chunk in the reduce dtype, filled by gradient hooks (see [Note: gradient buffers start
  uninitialised] in grad_buffer.py) and reduce-scattered into `grads.shard` (fp32), which the
  optimizer reads, in one of the layouts of [Note: gradient layouts] in grads.py.

[Note: secondary shards]
ZeRO++'s hierarchical partitioning (hpZ): when a forward with gradients on releases a chunk,
each rank keeps 1/s of the gathered payload (s = `secondary_shard_size`, the ranks of a node,
say) before freeing the rest, so that the gather backward needs runs inside those s ranks
(fast links) rather than over every rank. The secondary copy holds exactly what the primary
gather delivered (the payload's values, or a quantized gather's records: see [Note: quantized
gathers and hpZ] in chunk/wire/formats.py), so gathering from it changes no number; it is
valid until the payload changes (the step's `publish_master`, a checkpoint's `write_range`),
which drop it, and a gather from it drops it too, since that gather is backward's. Whether a
gather reads the secondary copy depends only on the sequence of releases and gathers, which
is the same on every rank, so every rank picks the same group. Its memory: 1/s of each such
chunk, on the device, from forward until backward gathers it (ZeRO++'s trade: more memory,
less inter-node traffic).

[Note: reducing gradients]
`grads.full` reaches its owners through the reduce side of the chunk's wire (see [Note: wire
formats] in chunk/wire/formats.py), launched for one chunk or a bucket by chunk/reduction.py
(see [Note: one reduction entry point]); the chunk prepares its buffer
(`grads.prepare_reduce`) and takes its slice (`grads.accept_reduced`).

[Note: pools]
Gathered buffers (`payload.full`, `payload.full_compute`, `grads.full`) always live on the
compute device. The shard lives in `placement.payload` (host memory is possible only for a
sharded chunk: it is copied to the device for each gather), and the optimizer side (`master`,
`grads.shard` and, through the views the optimizer steps, its state) in `placement.optim`.
`place()` sets both once, before the optimizer is built; copies between pools are counted in
`placement.bytes_to_device` / `bytes_to_host`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shardwise import comm
from shardwise.chunk.context import ChunkContext
from shardwise.chunk.facade_grads import InPayloadGrads, WholeGrads
from shardwise.chunk.grads import (
    AveragedFullGrads,
    GradSide,
    OwnBufferGrads,
    SliceOfFullGrads,
)
from shardwise.chunk.optimizer_state import OptimizerState
from shardwise.chunk.parameters import (
    adopt,
    compute_face,
    shard_face,
)
from shardwise.chunk.payload import Payload
from shardwise.chunk.placement import ChunkPlacement
from shardwise.chunk.resident import Resident, ResidentWatch
from shardwise.chunk.states import (
    GradState,
    Pool,
    TensorInfo,
    TensorState,
)
from shardwise.chunk.tiers import IN_MEMORY, OnDisk, SideTier
from shardwise.memory.disk_pool import DiskPool, DiskTierError


class Chunk:
    """Many parameters in one flat buffer; rank r owns the r-th of `world_size` equal slices.

    Args:
        chunk_id: position of the chunk in its manager, also its reduction order key.
        capacity_numel: elements the chunk may hold before it is closed.
        context: the settings its manager's chunks share: dtypes, device, groups, counters,
            gradient pre-division and wire formats (see `ChunkContext`).
        keep_gathered: keep the full payload resident (stages 0-2); only optimizer state
            and reduced gradients are sharded then.
        requires_grad: whether the chunk's parameters are trainable (frozen ones get a chunk of
            their own, with no gradient or master buffers).
    """

    master = Resident[torch.Tensor]()
    grads = Resident[GradSide]()
    """The gradient side, in the layout of [Note: gradient layouts] in grads.py."""

    def __init__(
        self,
        *,
        chunk_id: int,
        capacity_numel: int,
        context: ChunkContext,
        keep_gathered: bool,
        requires_grad: bool,
    ) -> None:
        self.chunk_id = chunk_id
        # Told whenever a buffer is replaced, resized or moved (see [Note: resident changes]
        # in chunk/resident.py): the memory manager's running totals, when set.
        self.resident_watch: ResidentWatch | None = None
        self.capacity_numel = capacity_numel
        self.context = context
        self.dtypes = context.dtypes
        self.device = context.device
        self.group = context.group
        self.stats = context.stats
        self.predivide_factor = context.predivide_factor
        self.replicate_group = context.topology.replicate
        self.secondary_group = context.topology.secondary
        self.keep_gathered = keep_gathered
        self.requires_grad = requires_grad
        self.world_size = comm.world_size(self.group)
        self.rank = comm.rank(self.group)
        self.tensors: list[TensorInfo] = []
        self.numel = 0
        self.closed = False
        self.num_trainable = 0
        # How its parameters are gathered and its gradients reduced, with the buffers that
        # only travel (see [Note: wire formats] in chunk/wire/formats.py).
        self.wire = context.wire.build(
            dtypes=self.dtypes,
            device=self.device,
            stats=self.stats,
            topology=context.topology,
            owner=self,
        )
        # Buffers, allocated by close(); see [Note: chunk buffers].
        self.payload = Payload(self, self.wire.gather)
        self.master = torch.empty(0, dtype=torch.float32, device=self.device)
        # Its own fp32 gradient shard unless a stage or facade picks another layout
        # (share_grad_shard_with_full, keep_averaged_grads, reuse_payload_for_grads,
        # keep_whole_grads).
        self.grads = OwnBufferGrads(self, torch.empty(0, dtype=torch.float32, device=self.device))
        # See [Note: pools].
        self.placement = ChunkPlacement(self, context.memory)
        # The views the optimizer steps and its state for them, which move with the master
        # (see [Note: the chunk owns its optimizer state] in optimizer_state.py).
        self.optimizer_state = OptimizerState(self)

    # ---- packing ---------------------------------------------------------------------------

    def can_fit(self, numel: int) -> bool:
        return not self.closed and self.numel + numel <= self.capacity_numel

    def append(self, name: str, param: nn.Parameter) -> None:
        """Reserve room for `param`; its data is copied in by close()."""
        if not self.can_fit(param.numel()):
            raise RuntimeError(
                f"chunk {self.chunk_id} cannot fit {name} ({param.numel()} elements)"
            )
        self.tensors.append(
            TensorInfo(name, param, self.numel, param.numel(), param.shape, TensorState.HOLD, param)
        )
        self.numel += param.numel()
        if param.requires_grad:
            self.num_trainable += 1

    @property
    def padded_numel(self) -> int:
        return -(-self.numel // self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def shard_begin(self) -> int:
        return self.rank * self.shard_numel

    def close(self, src_rank: int | None = 0) -> None:
        """Copy the parameters into the flat buffer, make every rank hold `src_rank`'s values
        (None: they already do), point the parameters at the buffer, and keep this rank's
        shard."""
        if self.closed:
            raise RuntimeError(f"chunk {self.chunk_id} is already closed")
        self.closed = True
        fp32_values = self.payload.fill(src_rank, self.replicate_group)
        for info in self.tensors:
            adopt(info.param, info.shape)
        self._bind_params()
        if self.requires_grad:
            self.master = self.payload.shard if fp32_values is None else fp32_values
            # See [Note: the gradient shard is allocated when first written] in grads.py.
            self.grads.shard = torch.empty(0, dtype=torch.float32, device=self.device)
            self.grads.zero_grad()
        if not self.keep_gathered:
            self.payload.release()

    def _bind_params(self) -> None:
        """Point the parameters at the compute buffer, once: a chunk that keeps its payload
        gathered makes each parameter a view of it; a sharded one gives each a compute face
        over it and makes the parameter its sharded face (see [Note: two faces of a stage-3
        parameter] in chunk/parameters.py). Gathers and releases then only fill and free the
        buffer's storage."""
        compute = self.payload.compute_buffer()
        for info in self.tensors:
            view = compute[info.offset : info.offset + info.numel].view(info.shape)
            if self.keep_gathered:
                info.param.data = view
            else:
                info.compute = compute_face(view, info.param)
                shard_face(info.param, info.name, self.dtypes.compute, self.device)

    # ---- pools (see [Note: pools]) ---------------------------------------------------------

    def place(self, *, payload: Pool, optim: Pool) -> None:
        """Put the shard in `payload` and the optimizer side in `optim` (see [Note: pools]).
        Call once after close() and before an optimizer steps this chunk."""
        if payload is Pool.HOST and self.keep_gathered:
            raise ValueError(
                f"chunk {self.chunk_id} keeps its payload gathered on the device: its shard "
                f"cannot live in host memory"
            )
        if payload is not self.placement.payload:
            self.payload.shard = self.placement.move_to(self.payload.shard, payload)
            self.placement.payload = payload
        if self.requires_grad:
            aliased = self.dtypes.payload == torch.float32 and payload is optim
            if aliased:
                self.master = self.payload.shard
            elif optim is not self.placement.optim or self.master is self.payload.shard:
                self.master = self.placement.move_to(self.master, optim, torch.float32)
            if optim is not self.placement.optim:
                self.grads.shard = self.placement.move_to(self.grads.shard, optim)
            self.placement.count_bytes(self.optimizer_state.follow(self.master), into=optim)
        self.placement.optim = optim

    def move_payload(self, pool: Pool) -> None:
        """Move the shard to `pool` while training runs (the "auto" policy). A master that was
        the shard itself stays where it is, as its own tensor, since the optimizer holds views
        of it."""
        if pool is self.placement.payload:
            return
        if self.keep_gathered:
            raise ValueError(f"chunk {self.chunk_id} keeps its payload gathered on the device")
        self.payload.shard = self.placement.move_to(self.payload.shard, pool)
        self.placement.payload = pool

    def move_optim(self, pool: Pool, *, disk: DiskPool | None = None) -> None:
        """Move the fp32 master, the gradient shard and the optimizer's state to `pool`, the
        optimizer's views following in place (see [Note: the chunk owns its optimizer state]
        in optimizer_state.py). An fp32 master that lands beside its shard becomes the shard
        itself. The disk tier (`disk`, for `Pool.DISK`) takes a side from host memory and gives
        it back there (see [Note: the disk tier] in memory/disk_pool.py)."""
        if pool is self.placement.optim or not self.requires_grad:
            self.placement.optim = pool
            return
        self.grads.land()  # the shard is read below
        if Pool.DISK in (pool, self.placement.optim):
            self._move_optim_to_or_from_disk(pool, disk)
            return
        if self.dtypes.payload == torch.float32 and pool is self.placement.payload:
            # An fp32 shard in the same pool is the master again, as place() makes it: no
            # second copy to hold, nor to copy into the shard after every step.
            self.payload.shard.copy_(self.placement.move_to(self.master, pool))
            self.master = self.payload.shard
        else:
            self.master = self.placement.move_to(self.master, pool, torch.float32)
        self.grads.shard = self.placement.move_to(self.grads.shard, pool)
        self.placement.count_bytes(self.optimizer_state.follow(self.master), into=pool)
        self.placement.optim = pool

    # ---- tiers (see [Note: tiers] in tiers.py) ---------------------------------------------

    @property
    def tier(self) -> SideTier:
        """Where the optimizer side lives between steps, and how a step brings it in."""
        return self.placement.tier

    def _move_optim_to_or_from_disk(self, pool: Pool, disk: DiskPool | None) -> None:
        source = self.placement.optim
        if pool is Pool.DISK:
            if source is not Pool.HOST:
                raise ValueError(
                    f"chunk {self.chunk_id}: the disk tier takes optimizer sides from host "
                    f"memory, this one is in {source.value} memory"
                )
            if disk is None:
                raise ValueError("a move to the disk tier needs its DiskPool")
            if (
                self.master is self.payload.shard
                or not _owns_its_storage(self.master)
                or self.context.memory.is_pinned(self.master)
            ):
                # The payload stays in memory, or the master is a buffer of the pinned pool
                # (registered with the device, and of its size class): the disk tier frees
                # what it writes, so the master on disk is a copy of its own, in plain memory
                # of exactly its size.
                self.master = self.master.clone()
                self.optimizer_state.follow(self.master)
            tier = OnDisk(disk, self.chunk_id, self.side_tensors, self.placement.count_disk)
            try:
                tier.evict().result()
            except OSError as error:
                # Nothing was freed: the side stays in host memory.
                tier.rollback()
                raise DiskTierError(
                    f"chunk {self.chunk_id} could not be written to the disk tier "
                    f"({disk.path}): {error}"
                ) from error
            tier.commit()
            self.placement.tier, self.placement.optim = tier, Pool.DISK
            return
        if pool is not Pool.HOST:
            raise ValueError(
                f"chunk {self.chunk_id}: an optimizer side leaves the disk tier for host "
                f"memory, not {pool.value} memory"
            )
        held = self.placement.tier
        assert isinstance(held, OnDisk)
        if not self.optim_side_resident:
            held.fetch().result()
        held.leave()
        self.placement.tier, self.placement.optim = IN_MEMORY, Pool.HOST
        if self.dtypes.payload == torch.float32 and self.placement.payload is Pool.HOST:
            self.payload.shard.copy_(self.master)
            self.master = self.payload.shard
            self.optimizer_state.follow(self.master)

    def side_tensors(self) -> list[torch.Tensor]:
        """The optimizer side a tier other than memory holds: the fp32 master and the
        optimizer's state (the gradient shard stays in memory)."""
        return [self.master, *self.optimizer_state.tensors]

    @property
    def optim_side_resident(self) -> bool:
        """Whether the master (and with it the state) is in memory: always, but on the disk
        tier only between a fetch and the next eviction."""
        return self.master.untyped_storage().size() > 0

    def ensure_resident(self) -> None:
        """Bring the master and state in now if their tier holds them elsewhere; they stay in
        memory (changes made to them included) until the next step sends them back."""
        if not self.optim_side_resident:
            self.tier.fetch().result()

    @contextmanager
    def optim_side_in_memory(self, *, write_back: bool) -> Iterator[None]:
        """The master and state readable in memory inside the block; from a tier elsewhere
        they are brought in and, on leaving, sent back as the current copy (`write_back`:
        they were changed, e.g. loaded from a checkpoint) or dropped. Elsewhere nothing
        happens."""
        if self.optim_side_resident:
            yield
            return
        self.tier.fetch().result()
        try:
            yield
        finally:
            if write_back:
                self.tier.evict().result()
                self.tier.commit()
            else:
                self.tier.drop()

    # ---- gradient layouts (see [Note: gradient layouts] in grads.py) -------------------------

    def share_grad_shard_with_full(self) -> None:
        """Stage 1 with fp32 reduction: keep the reduced slice in this rank's slice of the
        whole gradient buffer (`SliceOfFullGrads`); other chunks keep their own shard."""
        if not self.requires_grad or not self.keep_gathered or self.dtypes.reduce != torch.float32:
            return
        assert self.grads.state is not GradState.CLOSED, self.grads.state
        self.grads = SliceOfFullGrads(self, self.grads.full)

    def keep_averaged_grads(self) -> None:
        """Stage 1 with fp32 compute and reduction: the whole gradient buffer, averaged over
        the ranks in each synchronised backward and viewed by `.grad`; the optimizer reads
        this rank's slice of it (`AveragedFullGrads`)."""
        if not self.requires_grad:
            return
        assert self.keep_gathered, "stage 1 keeps its payload gathered"
        assert self.grads.state is not GradState.CLOSED, self.grads.state
        self.grads = AveragedFullGrads(self, self.grads.full)

    def reuse_payload_for_grads(self) -> None:
        """`reuse_fp16_shard`: keep the reduced gradients in the payload shard between
        backward and step (`InPayloadGrads`)."""
        if not self.requires_grad:
            return
        assert self.grads.state is not GradState.CLOSED, self.grads.state
        self.grads = InPayloadGrads(self)

    def keep_whole_grads(self) -> None:
        """Stage 0: one persistent gradient buffer that `.grad` views, and no optimizer side
        (`WholeGrads`)."""
        if not self.requires_grad:
            return
        self.grads = WholeGrads(self)
        # The user's optimizer steps the parameters in place: no master copy.
        if self.master is not self.payload.shard:
            self.master = torch.empty(0, dtype=torch.float32, device=self.device)

    # ---- tensor states ---------------------------------------------------------------------

    def set_compute(self, index: int) -> None:
        info = self.tensors[index]
        if info.state is TensorState.FREE:
            raise RuntimeError(f"{info.name} used while chunk {self.chunk_id} is not gathered")
        if info.state is TensorState.HOLD:
            info.state = TensorState.COMPUTE

    def set_hold(self, index: int) -> None:
        info = self.tensors[index]
        if info.state is TensorState.COMPUTE:
            info.state = TensorState.HOLD

    @property
    def in_use(self) -> bool:
        return any(info.state is TensorState.COMPUTE for info in self.tensors)

    # ---- after the optimizer step ----------------------------------------------------------

    def publish_master(self, *, wait: bool = True) -> None:
        """Copy the updated fp32 master into the payload; refresh the gathered copy if kept, in
        the background with `wait=False` (see [Note: deferred parameter gathers])."""
        self.payload.publish(self.master, wait=wait)

    def write_range(self, index: int, begin: int, values: torch.Tensor) -> None:
        """Overwrite elements [begin, begin + numel) of flattened tensor `index` with `values`,
        which must lie inside the part this rank owns (a checkpoint restores just that)."""
        self.payload.before_overwrite()
        self.ensure_resident()
        info = self.tensors[index]
        owned = self.tensor_shard_range(index)
        start = info.offset + begin - self.shard_begin
        if owned is None or start < owned[0] or start + values.numel() > owned[1]:
            raise ValueError(
                f"{info.name}: elements [{begin}, {begin + values.numel()}) are not owned by "
                f"rank {self.rank}"
            )
        flat = values.reshape(-1).to(self.device)
        self.payload.shard[start : start + flat.numel()].copy_(flat)
        if self.requires_grad and self.master is not self.payload.shard:
            self.master[start : start + flat.numel()].copy_(flat)

    def tensor_shard_range(self, index: int) -> tuple[int, int] | None:
        """The part of tensor `index` this rank owns, as (begin, end) within the shard."""
        info = self.tensors[index]
        begin = max(info.offset, self.shard_begin)
        end = min(info.offset + info.numel, self.shard_begin + self.shard_numel)
        if begin >= end:
            return None
        return begin - self.shard_begin, end - self.shard_begin

    def __repr__(self) -> str:
        return (
            f"Chunk(id={self.chunk_id}, tensors={len(self.tensors)}, numel={self.numel}, "
            f"padded={self.padded_numel}, state={self.payload.state.value})"
        )


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is the whole of its storage (freeing one frees the other only)."""
    return (
        tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )
