"""The payload of a chunk: its parameters' values, as this rank's shard and, while gathered, as
the whole flat buffer the parameters view (see [Note: chunk buffers] in chunk.py), with the
gathers, releases and publishes that move between the two, and hpZ's secondary copy (see
[Note: secondary shards] in chunk.py).

Its state is `ChunkState`: GATHERED (`full` valid, the tensors HOLD or COMPUTE) or SHARDED
(`full`'s storage freed, the tensors FREE). `gather` and `release` are the verbs between them;
a chunk that keeps its payload gathered (stages 0-2) is never released.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup

from shardwise import comm
from shardwise.chunk.context import ChunkContext
from shardwise.chunk.parameters import mark_pending, mark_settled
from shardwise.chunk.placement import ChunkPlacement
from shardwise.chunk.resident import Resident, resident_changed
from shardwise.chunk.states import ChunkDtypes, ChunkState, Pool, TensorInfo, TensorState
from shardwise.chunk.wire import GatherWire
from shardwise.comm import CommStats
from shardwise.memory import Pending, Streams


class _GradSide(Protocol):
    def check_payload_holds_params(self) -> None: ...


class OwningChunk(Protocol):
    """What the payload reads of its chunk (`chunk.Chunk`): its tensors (whose states follow
    the payload's), the shard's geometry, dtypes, groups, pools, and its gradient side (a
    payload holding gradients refuses a gather)."""

    chunk_id: int
    tensors: list[TensorInfo]
    dtypes: ChunkDtypes
    device: torch.device
    group: ProcessGroup | None
    secondary_group: ProcessGroup | None
    stats: CommStats
    keep_gathered: bool
    placement: ChunkPlacement
    context: ChunkContext

    @property
    def grads(self) -> _GradSide: ...

    @property
    def requires_grad(self) -> bool: ...

    @property
    def padded_numel(self) -> int: ...

    @property
    def shard_numel(self) -> int: ...

    @property
    def shard_begin(self) -> int: ...


class Payload:
    """One chunk's parameter values and their gathers (see the module docstring).

    Args:
        chunk: the chunk whose tensors these values are.
        wire: the gather side of the chunk's wire, which every all-gather of the payload goes
            through (see [Note: wire formats] in wire/formats.py).
    """

    full = Resident[torch.Tensor](transient=True)
    """The whole payload (numel padded to a multiple of the world size); its storage is freed
    while SHARDED."""
    full_compute = Resident[torch.Tensor | None](transient=True)
    """The compute copy the parameters view when the compute dtype differs from the payload's
    (filled by the wire's gather side, see [Note: wire formats] in wire/formats.py); None
    otherwise."""
    shard = Resident[torch.Tensor]()
    """This rank's slice of the payload, always resident (a view into `full` when the chunk
    keeps its payload gathered)."""
    secondary = Resident[torch.Tensor | None](transient=True)
    """hpZ: this rank's slice within its secondary group, in the wire's form, kept from a
    forward's release for backward's gather; None otherwise."""

    def __init__(self, chunk: OwningChunk, wire: GatherWire) -> None:
        # Changes to the buffers below are the chunk's (see [Note: resident changes] in
        # resident.py).
        self.__dict__["_resident_owner"] = chunk
        self._chunk = chunk
        dtypes, device = chunk.dtypes, chunk.device
        self.state = ChunkState.GATHERED
        self.wire = wire
        # The parameters view a compute copy of their own when they compute in another dtype.
        self._compute_copy = dtypes.compute != dtypes.payload
        self.full = torch.empty(0, dtype=dtypes.payload, device=device)
        self.full_compute = None
        self.shard = torch.empty(0, dtype=dtypes.payload, device=device)
        self.secondary = None
        self._pending_gather: Pending[Any] | None = None
        # publish(wait=False)'s all-gather.
        self._pending_publish: torch.distributed.Work | None = None

    def _enter(self, state: ChunkState, start: ChunkState) -> None:
        """Move to `state`, which only `start` leads to."""
        assert self.state is start, (self._chunk.chunk_id, self.state, state)
        self.state = state

    # ---- filling ---------------------------------------------------------------------------

    def fill(
        self,
        src_rank: int | None,
        replicate_group: ProcessGroup | None,
    ) -> torch.Tensor | None:
        """Copy the chunk's parameters into `full`, make every rank hold `src_rank`'s values
        (None: they already do; with `replicate_group`, group 0's reach the other shard groups
        too), and keep this rank's shard. Returns this rank's shard of the parameters' values
        in fp32 when the chunk needs fp32 masters beside a narrower payload, else None."""
        chunk = self._chunk
        # A trainable chunk stored in 16 bits takes its fp32 masters from the parameters'
        # own values, and the payload is cast from them: masters cast back up from the payload
        # would round a pretrained fp32 model's weights to 16 bits when it is wrapped.
        keep_fp32 = chunk.requires_grad and chunk.dtypes.payload != torch.float32
        values = torch.zeros(
            chunk.padded_numel,
            dtype=torch.float32 if keep_fp32 else chunk.dtypes.payload,
            device=chunk.device,
        )
        for info in chunk.tensors:
            values[info.offset : info.offset + info.numel].copy_(info.param.data.reshape(-1))
        # Ranks may have built the model with different random states: rank 0's values win,
        # as in DDP, so every rank starts from the same parameters.
        if src_rank is not None:
            comm.broadcast(values, src_rank, chunk.stats, chunk.group)
            if replicate_group is not None:  # then every group holds group 0's values
                comm.broadcast(values, 0, chunk.stats, replicate_group)
        own = slice(chunk.shard_begin, chunk.shard_begin + chunk.shard_numel)
        master = values[own].clone() if keep_fp32 else None
        self.full = values.to(chunk.dtypes.payload) if keep_fp32 else values
        if self._compute_copy:
            self.full_compute = torch.empty_like(self.full, dtype=chunk.dtypes.compute)
            self.full_compute.copy_(self.full)
        self.shard = self.full[own] if chunk.keep_gathered else self.full[own].clone()
        return master

    def compute_buffer(self) -> torch.Tensor:
        """The buffer the parameters view: `full`, or its compute copy."""
        return self.full if self.full_compute is None else self.full_compute

    # ---- gather / release ------------------------------------------------------------------

    def start_gather(self) -> None:
        """Launch the all-gather of the payload without waiting (a prefetch)."""
        if self.state is ChunkState.GATHERED or self._pending_gather is not None:
            return
        self._chunk.grads.check_payload_holds_params()
        pending = self._launch_gather(async_op=True)
        if pending is not None:
            self._pending_gather = pending
        else:
            self._finish_gather()

    @property
    def gather_pending(self) -> bool:
        """A prefetch (start_gather) is running and nothing has waited for it yet."""
        return self._pending_gather is not None

    def gather(self) -> None:
        """Make the full payload valid on this rank (waiting for a prefetch if one is running)."""
        if self.state is ChunkState.GATHERED:
            return
        self._chunk.grads.check_payload_holds_params()
        pending, self._pending_gather = self._pending_gather, None
        if pending is None:
            pending = self._launch_gather(async_op=False)
        if pending is not None:
            pending.wait()
        self._finish_gather()

    def _launch_gather(self, *, async_op: bool) -> Pending[Any] | None:
        """Every gather of a sharded payload starts here, through the wire (see [Note: wire
        formats] in wire/formats.py): from the secondary copy when there is one (see [Note:
        secondary shards] in chunk.py), else from this rank's shard, on the device; a shard
        in host memory on the gather stream (see [Note: a host shard's gather]). What is
        still running when it returns, if anything."""
        chunk = self._chunk
        if self.wire.receives_into_full:
            self._materialise(self.full)
        if self.secondary is not None:
            own = self._shard_on_device() if self.wire.restores_own_slice else None
            return self.wire.start_from_secondary(
                self.secondary, self.full, chunk.secondary_group, own, async_op=async_op
            )
        streams = chunk.context.memory.streams
        if not streams.enabled or chunk.placement.payload is Pool.DEVICE:
            return self.wire.start(
                self._shard_on_device(), self.full, chunk.group, async_op=async_op
            )
        # [Note: a host shard's gather]
        # The shard's copy to the device and the gather from it run on the gather stream,
        # after the work queued on the compute stream so far (which may still read the
        # buffers they write), so that a prefetch's copy runs beside the compute of the
        # modules before; the compute stream waits for them only when the chunk is used
        # (`_GatherInFlight.wait`). The buffers they use stay allocated until they are done
        # (see [Note: streams and events] in memory/streams.py).
        own = chunk.placement.start_move(self.shard, Pool.DEVICE, stream=streams.gather).tensor
        with streams.on(streams.gather):
            work = self.wire.start(own, self.full, chunk.group, async_op=async_op)
        done = streams.record(streams.gather)
        chunk.context.memory.hold_until(self.full, streams.gather, done)
        return _GatherInFlight(work, done, streams)

    def _shard_on_device(self) -> torch.Tensor:
        placement = self._chunk.placement
        if placement.payload is Pool.DEVICE:
            return self.shard
        return placement.move_to(self.shard, Pool.DEVICE)

    def _finish_gather(self) -> None:
        # The secondary copy served backward's gather (see [Note: secondary shards] in chunk.py).
        self.drop_secondary()
        compute = self.compute_buffer()
        self._materialise(compute)
        self.wire.finish(self.full, compute)
        if self.full_compute is not None and self.full.untyped_storage().size():
            # The 16-bit payload is only a staging buffer once the compute copy exists.
            self._free(self.full)
        self._enter(ChunkState.GATHERED, ChunkState.SHARDED)
        for info in self._chunk.tensors:
            info.state = TensorState.HOLD

    def release(self, *, keep_secondary: bool = False) -> None:
        """Drop the full payload, keeping only this rank's shard and, with `keep_secondary`
        and a secondary group, this rank's slice of it there (see [Note: secondary shards] in
        chunk.py)."""
        chunk = self._chunk
        if chunk.keep_gathered:
            raise RuntimeError(f"chunk {chunk.chunk_id} keeps its payload gathered")
        if self._pending_gather is not None:
            # A prefetch nobody used: it reads the shard, which the next step rewrites.
            self._pending_gather.wait()
            self._pending_gather = None
            self.wire.discard()
            self._free(self.full)
        if self.state is ChunkState.SHARDED:
            return
        for info in chunk.tensors:
            if info.state is TensorState.COMPUTE:
                raise RuntimeError(f"cannot release chunk {chunk.chunk_id}: {info.name} is in use")
        if keep_secondary and chunk.secondary_group is not None:
            self._keep_secondary()
        else:
            self.wire.drop_kept()
        self._free(self.full)
        if self.full_compute is not None:
            self._free(self.full_compute)
        self._enter(ChunkState.SHARDED, ChunkState.GATHERED)
        for info in chunk.tensors:
            info.state = TensorState.FREE

    def _keep_secondary(self) -> None:
        chunk = self._chunk
        size = comm.world_size(chunk.secondary_group)
        span = chunk.padded_numel // size
        begin = comm.rank(chunk.secondary_group) * span
        self.secondary = self.wire.secondary_copy(self.full, self.compute_buffer(), begin, span)

    def drop_secondary(self) -> None:
        """Forget the secondary copy (the payload is about to change, or backward is over)."""
        if self.secondary is not None:
            self.secondary = None

    def _materialise(self, buffer: torch.Tensor) -> None:
        # Only the gathered payload and its compute copy are resized in place (see [Note:
        # resident changes]).
        assert buffer is self.full or buffer is self.full_compute
        memory = self._chunk.context.memory
        if memory.holds(buffer):
            return
        memory.grow(buffer)
        resident_changed(self._chunk, transient=True)

    def _free(self, buffer: torch.Tensor) -> None:
        assert buffer is self.full or buffer is self.full_compute
        self._chunk.context.memory.shrink(buffer)
        resident_changed(self._chunk, transient=True)

    # ---- after the optimizer step ----------------------------------------------------------

    def publish(self, master: torch.Tensor, *, wait: bool = True) -> None:
        """Copy the updated fp32 `master` into the shard; refresh the gathered copy if kept, in
        the background with `wait=False` (see [Note: deferred parameter gathers] in
        runtime/param_gather.py)."""
        chunk = self._chunk
        self.wait_publish()
        self.drop_secondary()
        if not chunk.keep_gathered:
            self.release()  # a gathered copy left from a forward without backward is stale now
        if master is not self.shard:
            if chunk.placement.optim_memory is chunk.placement.payload:
                if chunk.placement.payload is not Pool.DEVICE:
                    # A gather's upload of this host shard may still be reading it.
                    chunk.context.memory.before_host_write(self.shard)
                self.shard.copy_(master)
            else:
                self._copy_across(master)
        if chunk.keep_gathered:
            self._gather_kept_copy(wait=wait)

    def _copy_across(self, master: torch.Tensor) -> None:
        """The updated master into the shard in the other pool, through the copy path.

        [Note: updated parameters go up from pinned staging]
        A master in host memory is cast to the payload's dtype on the host, into a pinned
        staging buffer from the engine's pool, which goes up on the copy stream; the compute
        stream waits for it before the shard is next read, the host does not. The host may
        write the master again at once (the next chunk's step never touches it, the next
        step does): the copy reads the staging buffer, which the pool hands out again only
        once the copy has completed. Without streams the cast and copy are one `copy_`, as
        they always were (the same rounding either way)."""
        placement, memory = self._chunk.placement, self._chunk.context.memory
        if placement.payload is Pool.DEVICE and memory.streams.enabled:
            staging = memory.empty(master.numel(), self.shard.dtype, host=True)
            staging.copy_(master)
            placement.start_copy_into(self.shard, staging, into=Pool.DEVICE).wait()
        else:
            placement.start_copy_into(self.shard, master, into=placement.payload).wait()

    def publish_unchanged(self) -> None:
        """A step that left this chunk as it was on this rank (its disk tier failed): issue
        the collective a publish would, so every rank's stay matched."""
        if self._chunk.keep_gathered:
            self.wait_publish()
            self._gather_kept_copy(wait=True)

    def _gather_kept_copy(self, *, wait: bool) -> None:
        """All-gather the shards into the full copy a stage-1/2 chunk keeps."""
        # In place: the shard is this rank's slice of `full`, where an all-gather puts it anyway
        # (NCCL and gloo both allow it; a copy of the shard cost 3 ms per 4 MiB here).
        work = self.wire.start(self.shard, self.full, self._chunk.group, async_op=not wait)
        if work is None:
            self._refresh_compute_copy()
        else:
            self._pending_publish = work
            for info in self._chunk.tensors:
                mark_pending(info.param, self.wait_publish)

    @property
    def publish_pending(self) -> bool:
        """A publish's all-gather (`publish(wait=False)`) is running and nothing has waited
        for it yet."""
        return self._pending_publish is not None

    def wait_publish(self) -> None:
        """Wait for a background all-gather started by `publish(wait=False)`."""
        if self._pending_publish is not None:
            work, self._pending_publish = self._pending_publish, None
            work.wait()
            for info in self._chunk.tensors:
                mark_settled(info.param)
            self._refresh_compute_copy()

    def _refresh_compute_copy(self) -> None:
        self.wire.finish(self.full, self.compute_buffer())

    def before_overwrite(self) -> None:
        """Before this rank's shard is written directly (a checkpoint's values): no publish
        in flight, no secondary copy, no gathered copy left stale."""
        self.wait_publish()
        self.drop_secondary()
        if not self._chunk.keep_gathered:
            self.release()

    def refresh_gathered(self) -> None:
        """After this rank's shards were overwritten, rebuild the full copy every rank keeps
        (stages 1 and 2); a collective over the chunk's group."""
        if self._chunk.keep_gathered:
            self.wait_publish()
            self._gather_kept_copy(wait=True)


class _GatherInFlight:
    """A gather running on the gather stream (see [Note: a host shard's gather]): `wait()`
    makes the current stream wait for it (its collective, then the stream's event)."""

    __slots__ = ("_done", "_streams", "_work")

    def __init__(self, work: Pending[Any] | None, done: Any, streams: Streams) -> None:
        self._work, self._done, self._streams = work, done, streams

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        self._streams.wait(self._done)
