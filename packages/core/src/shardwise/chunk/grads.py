"""The gradient side of a chunk: gradients copied in as autograd produces them, reduced over
ranks, and read by the optimizer step (see [Note: chunk buffers] and [Note: reducing gradients]
in chunk.py).

[Note: gradient layouts]
Where a chunk keeps the reduced gradient shard the optimizer reads is fixed before the first
backward, and each place is a class of its own, with the `GradState`s it can be in and verbs
that assert where they start from, so no method branches over the places:
- `OwnBufferGrads` (stages 2-3, and stage 1 with a 16-bit reduction): an fp32 buffer of its
  own (`shard`) into which each reduction adds. STALE after `zero_grad()`, OPEN once a reduced
  gradient arrived.
- `AveragedFullGrads` (stage 1 with fp32 compute and reduction): the whole gradient buffer
  (`full`), averaged over the ranks in place during each synchronised backward (an
  all-reduce, as DDP's), `.grad` of every tensor viewing it; the optimizer reads this rank's
  own slice of it (see [Note: stage 1 averages in backward]). OPEN while gradients arrive,
  CLOSED once the step has read (and maybe unscaled or clipped) its slice.
- `SliceOfFullGrads` (stage 1 with fp32 reduction where `.grad` shows nothing: 16-bit
  compute, or hybrid sharding): this rank's own slice of the whole local gradient buffer
  (`full`), which stage 1 keeps anyway; the reduction at the step writes the reduced slice
  there. OPEN while local gradients accumulate, CLOSED once reduced in place.
- `InPayloadGrads` (`ShardedModelV2(reuse_fp16_shard=True)`): the 16-bit payload shard holds
  the reduced gradient between backward and step, the fp32 master restoring the parameters at
  the step. OPEN while the payload holds parameters, CLOSED while it holds the gradient.
- `WholeGrads` (stage 0, `ColoDDP`): no shard; the whole gradient buffer, in the parameters'
  dtype, is averaged across the replicas in place after each backward and `.grad` of every
  tensor views it, as DDP's `gradient_as_bucket_view` (see [Note: stage 0] in reduction.py).
The last two serve one facade each, and live in facade_grads.py: the engine's stages 1-3
never build them.

[Note: stage 1 averages in backward]
A user reads `.grad` after backward as DDP gives it: the average over the ranks (ColossalAI's
low-level ZeRO at stage 1 gives the same through `get_param_grad`). Stage 1 used to reduce
once, at the step, with a reduce-scatter of the local sum, which left `.grad` showing this
rank's own unreduced gradient until then. Where `.grad` can view an fp32 buffer, stage 1 now
does what DDP does instead: each chunk's whole buffer is all-reduced in place as soon as its
gradients are complete in a synchronised backward (in the fixed order of the reducer, in the
background of backward), so every rank holds the average and `.grad` views it; the optimizer
reads its own slice of it. Communication is DDP's, one all-reduce per synchronised backward
(whose bytes equal a reduce-scatter plus the all-gather that would otherwise bring the
average back), and none inside `no_sync()`, where `.grad` accumulates this rank's own sum, as
DDP's does, until the next backward outside averages everything accumulated since
`zero_grad()`. Backward passes without `no_sync()` accumulate as under DDP: each adds its local
gradient onto the average so far, which is averaged again. With 2 ranks every element is
(a + b) / 2 as before, so fp32 results stay bit-identical. Where `.grad` shows nothing (16-bit
compute) or the average would have to cross shard groups whole (hybrid sharding), stage 1
keeps reducing once at the step (`SliceOfFullGrads`, `OwnBufferGrads`), which is cheaper.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from shardwise.chunk.context import ChunkContext
from shardwise.chunk.grad_buffer import owns_storage, zero_unwritten
from shardwise.chunk.norm_partial import norm_partial
from shardwise.chunk.placement import ChunkPlacement
from shardwise.chunk.resident import Resident
from shardwise.chunk.states import ChunkDtypes, GradLayout, GradState, Pool, TensorInfo, TensorState
from shardwise.memory import PendingCopy


class _Payload(Protocol):
    @property
    def shard(self) -> torch.Tensor: ...


class OwningChunk(Protocol):
    """What the gradient side reads of its chunk (`chunk.Chunk`): the tensors and the shard's
    geometry, the dtypes, and for the layouts that need them the payload shard, the fp32
    master and its placement."""

    tensors: list[TensorInfo]
    num_trainable: int
    world_size: int
    predivide_factor: float
    dtypes: ChunkDtypes
    device: torch.device
    keep_gathered: bool
    master: torch.Tensor
    placement: ChunkPlacement
    context: ChunkContext

    @property
    def payload(self) -> _Payload: ...

    @property
    def padded_numel(self) -> int: ...

    @property
    def shard_numel(self) -> int: ...

    @property
    def shard_begin(self) -> int: ...


class GradSide:
    """A chunk's gradients in one of the layouts of [Note: gradient layouts].

    Args:
        chunk: the chunk whose tensors and geometry these gradients follow.
        shard: the reduced gradient shard the optimizer reads (empty where the layout has
            none).
        full: the whole gradient buffer kept from before, or None.
    """

    layout: ClassVar[GradLayout]
    # The states this layout can be in; `_enter` refuses any other.
    STATES: ClassVar[frozenset[GradState]]
    full = Resident[torch.Tensor | None](transient=True)
    """Gradients of the whole chunk, in the reduce dtype (see [Note: gradient buffers start
    uninitialised] in grad_buffer.py)."""
    shard = Resident[torch.Tensor]()
    """This rank's reduced gradient slice, fp32, which the optimizer reads."""

    def __init__(
        self, chunk: OwningChunk, shard: torch.Tensor, full: torch.Tensor | None = None
    ) -> None:
        # Changes to the buffers below are the chunk's (see [Note: resident changes]).
        self.__dict__["_resident_owner"] = chunk
        self._chunk = chunk
        self.full = full
        self.shard = shard
        # Whether `shard` is a view into `full` (stage 1), so its bytes are counted once.
        self.shard_in_full = False
        self.state = GradState.OPEN
        # Whether `.grad` of each tensor views its part of `full` (see `exposed`).
        self.exposes = False
        # Tensors a gradient reached on this rank since zero_grad(): the others are left out
        # of the step, as torch leaves a parameter whose .grad is None.
        self.received: set[int] = set()
        # Tensors whose gradient the uninitialised `full` holds; None once it is all valid.
        self._written: set[int] | None = None
        self._ready = 0
        # `full` holds local gradients no reduction has taken yet.
        self._unreduced = False
        # See [Note: norm partials] in norm_partial.py: the norm the step clips by, set by its
        # optimizer, and this chunk's share of it, taken where the reduction ran.
        self.norm_type: float | None = None
        self.norm_partial: torch.Tensor | None = None

    def _enter(self, state: GradState, *starts: GradState) -> None:
        """Move to `state`, from one of `starts` (any state of this layout when none given)."""
        assert state in self.STATES, (type(self).__name__, state)
        assert not starts or self.state in starts, (type(self).__name__, self.state, state)
        self.state = state

    # ---- backward ----------------------------------------------------------------------------

    def add(self, index: int, grad: torch.Tensor) -> bool:
        """Accumulate one parameter's gradient into `full`. Returns True when every trainable
        tensor of the chunk has its gradient for this pass."""
        self._check_open_to_gradients()
        chunk = self._chunk
        info = chunk.tensors[index]
        if self.full is None and self._can_adopt(info, grad):
            # See [Note: a gradient that is the whole buffer] in grad_buffer.py.
            self.full = grad.detach().view(-1)
            self._written = {index}
        elif self.full is None:  # see [Note: gradient buffers start uninitialised]
            self.full = chunk.context.memory.empty(chunk.padded_numel, chunk.dtypes.reduce)
            self._written = set()
        target = self.full[info.offset : info.offset + info.numel]
        self.received.add(index)
        self._unreduced = True
        if self.exposes:
            # `.grad` is a view of `target` (see exposed()): autograd accumulated into it in
            # place, or made a new tensor that holds the sum so far.
            if grad.data_ptr() != target.data_ptr():
                target.copy_(grad.reshape(-1))
        elif target.data_ptr() == grad.data_ptr():
            pass  # adopted above
        elif self._written is None or index in self._written:
            target.add_(grad.reshape(-1))
        else:
            target.copy_(grad.reshape(-1))
            self._written.add(index)
        if info.state is not TensorState.READY_FOR_REDUCE:
            info.state = TensorState.READY_FOR_REDUCE
            self._ready += 1
        return self._ready == chunk.num_trainable

    def _check_open_to_gradients(self) -> None:
        """Refuse a gradient this layout cannot take now (see the subclasses)."""

    def _can_adopt(self, info: TensorInfo, grad: torch.Tensor) -> bool:
        chunk = self._chunk
        return (
            not self.exposes
            and info.offset == 0
            and info.numel == chunk.padded_numel
            and grad.dtype == chunk.dtypes.reduce
            and grad.device == chunk.device
            and owns_storage(grad)
        )

    def exposed(self, index: int) -> torch.Tensor | None:
        """What `.grad` of tensor `index` shows after its gradient reached the chunk: a view
        into `full` (no copy) where this layout exposes it, holding the sum so far (averaged
        over the ranks once a synchronised backward ends), as DDP users read `.grad`;
        elsewhere None (the chunk holds it)."""
        if not self.exposes:
            return None
        assert self.full is not None
        info = self._chunk.tensors[index]
        return self.full[info.offset : info.offset + info.numel].view(info.shape)

    def end_pass(self) -> None:
        """Close a backward pass whose gradients stay unreduced in `full` (no_sync, or stage
        1), so the next pass counts its gradients afresh."""
        self._initialise_unwritten()
        self._ready = 0
        for info in self._chunk.tensors:
            if info.state is TensorState.READY_FOR_REDUCE:
                info.state = TensorState.HOLD

    def _initialise_unwritten(self) -> None:
        if self.full is not None and self._written is not None:
            zero_unwritten(self.full, self._chunk.tensors, self._written)
        self._written = None  # every element is valid: later gradients add

    # ---- reduction ---------------------------------------------------------------------------

    def prepare_reduce(self) -> torch.Tensor:
        """`full`, ready to reduce-scatter (pre-divided when asked). A chunk whose parameters
        got no gradient on this rank contributes zeros, so every rank issues the same
        collectives."""
        chunk = self._chunk
        if self.full is None:
            self.full = torch.zeros(
                chunk.padded_numel, dtype=chunk.dtypes.reduce, device=chunk.device
            )
        self._initialise_unwritten()
        if chunk.predivide_factor != 1.0:
            self.full.div_(chunk.predivide_factor)
        return self.full

    def accept_reduced(self, reduced: torch.Tensor, *, keep_full: bool) -> None:
        """Take this rank's reduce-scattered slice: finish the average over ranks, keep it as
        the layout says, and free (or zero, with `keep_full`) `full`."""
        post = self._chunk.world_size / self._chunk.predivide_factor
        if post != 1.0:
            reduced.div_(post)
        self._take_reduced(reduced)
        if keep_full:
            assert self.full is not None
            self.land()  # `reduced` may view `full`, which is zeroed next
            self.full.zero_()
        else:
            self._drop_full()
        self._unreduced = False
        self.end_pass()

    def _drop_full(self) -> None:
        full, self.full = self.full, None
        self._written = None
        self._chunk.context.memory.give_back(full)  # see [Note: a pool of host buffers]

    def _take_reduced(self, reduced: torch.Tensor) -> None:
        raise NotImplementedError

    def land(self) -> None:
        """Wait for the reduced gradient still being copied into `shard` (see [Note: reduced
        gradients leave for the host]), if any."""

    # ---- step --------------------------------------------------------------------------------

    def check_payload_holds_params(self) -> None:
        """Before a gather: refuse when the payload holds gradients (see `InPayloadGrads`)."""

    def for_step(self) -> torch.Tensor:
        """The fp32 gradient shard the optimizer reads."""
        return self.shard

    def end_step(self) -> None:
        """After a step, taken or skipped."""

    @property
    def cleared(self) -> bool:
        """zero_grad() ran and no gradient reached `shard` since: it holds no gradient,
        whatever its (stale) elements say."""
        return self.state is GradState.STALE

    def zero_grad(self) -> None:
        """Forget the gradients."""
        self.received.clear()
        self.norm_partial = None

    def expose_reached(self, reached: list[bool]) -> None:
        """Once a synchronised backward has averaged the gradients: show `.grad` of the
        tensors some rank's gradient reached (`reached`, one flag per tensor, in order), where
        this layout shows `.grad` at all (`exposes`)."""

    def _hide(self) -> None:
        if self.exposes:
            for info in self._chunk.tensors:
                info.compute.grad = None


class OwnBufferGrads(GradSide):
    """An fp32 gradient shard of its own, into which each reduction adds (see [Note: gradient
    layouts]).

    [Note: the gradient shard is allocated when first written]
    A chunk starts STALE with an empty shard: the first reduction (or a step with none)
    allocates it, in the optim pool's memory. Until the first backward a rank holds no
    gradient memory, so a model wrapped and then given an optimizer whose state goes to the
    disk tier never holds its fp32 masters, which wait there, beside its gradient shards."""

    layout = GradLayout.OWN_BUFFER
    STATES = frozenset({GradState.STALE, GradState.OPEN})

    # [Note: reduced gradients leave for the host]
    # Where the optimizer side lives in host memory, each chunk's reduced gradient is copied
    # into its host shard as its reduction is accepted. That copy starts on the copy stream
    # (memory/memory.py), after the reduction, and backward goes on meanwhile; it lands (the
    # host waits for it) only where the shard is read: the step (`for_step`), a second
    # reduction adding into it, `zero_grad()`, a move of the shard. On a CPU it is a plain
    # copy, landed at once.
    _landing: PendingCopy | None = None

    def _allocate(self) -> None:
        chunk = self._chunk
        if self.shard.numel() != chunk.shard_numel:
            placement = chunk.placement
            self.shard = placement.empty(chunk.shard_numel, torch.float32, placement.optim_memory)

    def _take_reduced(self, reduced: torch.Tensor) -> None:
        chunk = self._chunk
        if self.state is GradState.STALE:  # the first gradients since zero_grad()
            self.norm_partial = norm_partial(reduced, self.norm_type)
            self._allocate()
            # Straight into the shard, wherever it lives (stage 2's offload copies each
            # bucket's reduced gradient to the host here, as its reduction completes).
            if chunk.placement.optim is not Pool.DEVICE:
                self._landing = chunk.placement.start_copy_into(self.shard, reduced, Pool.HOST)
            else:
                self.shard.copy_(reduced)
        else:
            self.land()
            self.norm_partial = None  # of a sum it has not seen
            if chunk.placement.optim is not Pool.DEVICE:
                reduced = chunk.placement.move_to(reduced, Pool.HOST)
            self.shard.add_(reduced)
        self._enter(GradState.OPEN)

    def land(self) -> None:
        landing, self._landing = self._landing, None
        if landing is not None:
            landing.wait()

    def for_step(self) -> torch.Tensor:
        if self.state is GradState.STALE:  # no gradient reached it since zero_grad()
            self._allocate()
            self.shard.zero_()
            self._enter(GradState.OPEN, GradState.STALE)
        self.land()
        return self.shard

    def zero_grad(self) -> None:
        """The next reduced gradients overwrite the shard instead of adding to it, which
        spares a pass over it (zeroed at the step if none came). Local gradients not reduced
        yet (a pass under no_sync, a backward that raised) are dropped with it."""
        self.land()
        super().zero_grad()
        if self.full is not None:
            self._drop_full()
        self._unreduced = False
        self._enter(GradState.STALE)


class SliceOfFullGrads(GradSide):
    """Stage 1 with fp32 reduction where `.grad` shows nothing (16-bit compute, hybrid
    sharding): the reduced slice lives in this rank's own slice of `full`, which stage 1 keeps
    anyway, instead of a separate fp32 shard: the model state is then the ZeRO formula's. The
    next backward would add onto that slice, so zero_grad() must come between step() and the
    next backward (see [Note: gradient layouts])."""

    layout = GradLayout.SLICE_OF_FULL
    STATES = frozenset({GradState.OPEN, GradState.CLOSED})

    def __init__(self, chunk: OwningChunk, full: torch.Tensor | None) -> None:
        if full is None:
            full = torch.zeros(chunk.padded_numel, dtype=torch.float32, device=chunk.device)
        super().__init__(chunk, _own_slice_or_host_shard(chunk, full), full)
        self.shard_in_full = chunk.placement.optim is Pool.DEVICE

    def _check_open_to_gradients(self) -> None:
        if self.state is GradState.CLOSED:
            raise ValueError(_ZERO_GRAD_FIRST)

    def accept_reduced(self, reduced: torch.Tensor, *, keep_full: bool) -> None:
        assert self.full is not None and keep_full
        post = self._chunk.world_size / self._chunk.predivide_factor
        if post != 1.0:
            reduced.div_(post)
        if reduced.data_ptr() != self.shard.data_ptr():  # all-reduce: already there
            if not self.shard_in_full:  # the optimizer side is in host memory
                self._chunk.placement.count_copy(reduced, into=Pool.HOST)
            self.shard.copy_(reduced)  # over this rank's own unreduced gradients
        begin, numel = self._chunk.shard_begin, self._chunk.shard_numel
        if self.shard_in_full:
            self.full[:begin].zero_()
            self.full[begin + numel :].zero_()
        else:  # the reduced slice is in host memory: the next backward starts from zero
            self.full.zero_()
        self._unreduced = False
        self._enter(GradState.CLOSED, GradState.OPEN)  # add() refused gradients otherwise
        self.end_pass()

    def zero_grad(self) -> None:
        """The next backward adds onto this rank's slice: it starts from zero; so does the
        rest of `full` where local gradients no reduction took are left in it (passes
        before the step, or a backward that raised), else it is zero already."""
        super().zero_grad()
        assert self.full is not None
        if self._unreduced:
            self.full.zero_()
        if not (self._unreduced and self.shard_in_full):
            self.shard.zero_()
        self._unreduced = False
        self._enter(GradState.OPEN)


class ViewedGrads(GradSide):
    """The layouts whose whole gradient buffer `.grad` of every tensor views and which average
    it over ranks in place, as DDP's buckets (`AveragedFullGrads`, `WholeGrads`)."""

    def _contribute_what_grad_holds(self) -> None:
        """Before the average: a tensor no gradient reached in this pass contributes what its
        `.grad` holds, as it does to DDP's bucket: zeros once zero_grad() set it to None, the
        value a user assigned, or (still the view) the sum of the passes before."""
        assert self.full is not None
        for info in self._chunk.tensors:
            if info.state is TensorState.READY_FOR_REDUCE:
                continue
            target = self.full[info.offset : info.offset + info.numel]
            grad = info.compute.grad
            if grad is None:
                target.zero_()
            elif grad.data_ptr() != target.data_ptr():
                target.copy_(grad.reshape(-1))

    def expose_reached(self, reached: list[bool]) -> None:
        """`.grad` of each tensor that some rank's gradient reached views its part of the
        averaged buffer; the others keep None, as DDP leaves a parameter no rank used."""
        assert self.full is not None
        for info, flag in zip(self._chunk.tensors, reached, strict=True):
            if not flag:
                continue
            view = self.full[info.offset : info.offset + info.numel].view(info.shape)
            if info.compute.grad is None or info.compute.grad.data_ptr() != view.data_ptr():
                info.compute.grad = view

    def zero_grad(self) -> None:
        super().zero_grad()
        self._hide()


class AveragedFullGrads(ViewedGrads):
    """Stage 1 with fp32 compute and reduction: the whole gradient buffer, averaged over the
    ranks in place during each synchronised backward and viewed by `.grad`, as DDP's
    `gradient_as_bucket_view`; the optimizer reads this rank's own slice of it (see [Note:
    stage 1 averages in backward]). The step may unscale or clip that slice in place, so
    `.grad` is hidden then and zero_grad() must come between step() and the next backward."""

    layout = GradLayout.AVERAGED_FULL
    STATES = frozenset({GradState.OPEN, GradState.CLOSED})

    def __init__(self, chunk: OwningChunk, full: torch.Tensor | None) -> None:
        assert chunk.dtypes.compute == chunk.dtypes.reduce == torch.float32, chunk.dtypes
        if full is None:
            full = torch.zeros(chunk.padded_numel, dtype=torch.float32, device=chunk.device)
        super().__init__(chunk, _own_slice_or_host_shard(chunk, full), full)
        self.shard_in_full = chunk.placement.optim is Pool.DEVICE
        self.exposes = True

    def _check_open_to_gradients(self) -> None:
        if self.state is GradState.CLOSED:
            raise ValueError(_ZERO_GRAD_FIRST)

    def prepare_reduce(self) -> torch.Tensor:
        """`full`, ready to be summed over the ranks in place (pre-divided when asked)."""
        assert self.full is not None
        self._contribute_what_grad_holds()
        if self._chunk.predivide_factor != 1.0:
            self.full.div_(self._chunk.predivide_factor)
        return self.full

    def accept_reduced(self, reduced: torch.Tensor, *, keep_full: bool) -> None:
        """`reduced` is `full` itself, summed over the ranks: finish the average. The buffer
        stays, whatever `keep_full` says: `.grad` views it."""
        assert self.full is not None and reduced.data_ptr() == self.full.data_ptr()
        post = self._chunk.world_size / self._chunk.predivide_factor
        if post != 1.0:
            self.full.div_(post)
        if not self.shard_in_full:
            # The optimizer side is in host memory: this rank's slice of the average goes
            # there as its reduction completes (stage 1's offload).
            chunk = self._chunk
            own = self.full[chunk.shard_begin : chunk.shard_begin + chunk.shard_numel]
            chunk.placement.count_copy(own, into=Pool.HOST)
            self.shard.copy_(own)
        self.end_pass()

    def end_step(self) -> None:
        """The step read this rank's slice and may have scaled it in place: `.grad` would
        show a half-scaled gradient, so it is hidden until zero_grad()."""
        self._hide()
        self._enter(GradState.CLOSED)

    def zero_grad(self) -> None:
        """Forget the gradients: the buffer starts from zero and `.grad` is None."""
        super().zero_grad()
        assert self.full is not None
        self.full.zero_()
        if not self.shard_in_full:
            self.shard.zero_()
        self._enter(GradState.OPEN)


def _own_slice_or_host_shard(chunk: OwningChunk, full: torch.Tensor) -> torch.Tensor:
    """Stage 1's gradient shard: this rank's slice of `full`, or, where the optimizer side
    lives in host memory (offload), an fp32 buffer of its own there."""
    if chunk.placement.optim is Pool.DEVICE:
        return full[chunk.shard_begin : chunk.shard_begin + chunk.shard_numel]
    return torch.zeros(chunk.shard_numel, dtype=torch.float32, device=chunk.placement.host)


def no_shard(chunk: OwningChunk) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=chunk.device)


_ZERO_GRAD_FIRST = (
    "stage 1 keeps the reduced gradients of the last step in this rank's slice of the "
    "gradient buffer: call optimizer.zero_grad() between step() and the next backward"
)
