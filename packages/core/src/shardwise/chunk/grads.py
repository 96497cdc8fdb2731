"""The gradient side of a chunk: gradients copied in as autograd produces them, reduced over
ranks, and read by the optimizer step, in the layout `GradLayout` names and the state
`GradState` tracks (see [Note: chunk buffers] and [Note: reducing gradients] in chunk.py).
"""

from __future__ import annotations

import torch

from shardwise.chunk.grad_buffer import owns_storage, zero_unwritten
from shardwise.chunk.pools import PoolMoves
from shardwise.chunk.states import GradLayout, GradState, Pool, TensorInfo, TensorState


class GradSide(PoolMoves):
    """The gradient methods of `Chunk`, which sets every attribute declared here."""

    tensors: list[TensorInfo]
    grad_full: torch.Tensor | None
    grad_layout: GradLayout
    grad_state: GradState
    grads_received: set[int]
    exposes_grads: bool
    num_grads_ready: int
    num_trainable: int
    predivide_factor: float
    world_size: int
    _grads_written: set[int] | None

    @property
    def padded_numel(self) -> int:
        raise NotImplementedError

    @property
    def shard_numel(self) -> int:
        raise NotImplementedError

    @property
    def shard_begin(self) -> int:
        raise NotImplementedError

    def add_grad(self, index: int, grad: torch.Tensor) -> bool:
        """Accumulate one parameter's gradient into the chunk's gradient buffer.

        Returns True when every trainable tensor of the chunk has its gradient for this pass.
        """
        info = self.tensors[index]
        if self.grad_layout is GradLayout.SLICE_OF_FULL and self.grad_state is GradState.CLOSED:
            raise ValueError(_ZERO_GRAD_FIRST)
        if self.grad_full is None and self._can_adopt(info, grad):
            # See [Note: a gradient that is the whole buffer] in grad_buffer.py.
            self.grad_full = grad.detach().view(-1)
            self._grads_written = {index}
        elif self.grad_full is None:  # see [Note: gradient buffers start uninitialised]
            self.grad_full = torch.empty(
                self.padded_numel, dtype=self.dtypes.reduce, device=self.device
            )
            self._grads_written = set()
        target = self.grad_full[info.offset : info.offset + info.numel]
        self.grads_received.add(index)
        if self.exposes_grads:
            # `.grad` is a view of `target` (see exposed_grad()): autograd accumulated into it
            # in place, or made a new tensor that holds the sum so far.
            if grad.data_ptr() != target.data_ptr():
                target.copy_(grad.reshape(-1))
        elif target.data_ptr() == grad.data_ptr():
            pass  # adopted above
        elif self._grads_written is None or index in self._grads_written:
            target.add_(grad.reshape(-1))
        else:
            target.copy_(grad.reshape(-1))
            self._grads_written.add(index)
        if info.state is not TensorState.READY_FOR_REDUCE:
            info.state = TensorState.READY_FOR_REDUCE
            self.num_grads_ready += 1
        return self.num_grads_ready == self.num_trainable

    def _can_adopt(self, info: TensorInfo, grad: torch.Tensor) -> bool:
        return (
            not self.exposes_grads
            and info.offset == 0
            and info.numel == self.padded_numel
            and grad.dtype == self.dtypes.reduce
            and grad.device == self.device
            and owns_storage(grad)
        )

    def exposed_grad(self, index: int) -> torch.Tensor | None:
        """What `.grad` of tensor `index` shows after its gradient reached the chunk: a view
        into the whole gradient buffer (no copy), holding at stage 1 its local, unreduced
        gradient and at stage 0 the sum so far (averaged once backward ends), as DDP users
        read `.grad`; elsewhere None (the chunk holds it)."""
        if not self.exposes_grads:
            return None
        assert self.grad_full is not None
        info = self.tensors[index]
        return self.grad_full[info.offset : info.offset + info.numel].view(info.shape)

    def prepare_reduce(self) -> torch.Tensor:
        """The gradient buffer, ready to reduce-scatter (pre-divided when asked). A chunk whose
        parameters got no gradient on this rank contributes zeros, so every rank issues the
        same collectives."""
        if self.grad_layout is GradLayout.WHOLE:
            return self._take_param_grads()
        if self.grad_full is None:
            self.grad_full = torch.zeros(
                self.padded_numel, dtype=self.dtypes.reduce, device=self.device
            )
        self._initialise_unwritten_grads()
        if self.predivide_factor != 1.0:
            self.grad_full.div_(self.predivide_factor)
        return self.grad_full

    def accept_reduced(self, reduced: torch.Tensor, *, keep_full: bool) -> None:
        """Take this rank's reduce-scattered slice: finish the average over ranks, add it to
        `grad_shard`, and free (or zero, with `keep_full`) the gradient buffer. At stage 0 the
        buffer was averaged in place and stays, whatever `keep_full` says: `.grad` views it."""
        if self.grad_layout is GradLayout.WHOLE:
            self.end_pass_without_reduce()
            return
        post = self.world_size / self.predivide_factor
        if post != 1.0:
            reduced.div_(post)
        layout, state = self.grad_layout, self.grad_state
        if layout is GradLayout.IN_PAYLOAD:
            if state is GradState.CLOSED:
                raise ValueError(_NO_ACCUMULATION)
            self.shard.copy_(reduced)
            self.grad_state = GradState.CLOSED
        elif layout is GradLayout.SLICE_OF_FULL:
            assert self.grad_full is not None and keep_full
            assert state is GradState.OPEN, state  # add_grad() refused gradients otherwise
            if reduced.data_ptr() != self.grad_shard.data_ptr():  # all-reduce: already there
                self.grad_shard.copy_(reduced)  # over this rank's own unreduced gradients
            self.grad_full[: self.shard_begin].zero_()
            self.grad_full[self.shard_begin + self.shard_numel :].zero_()
            self.grad_state = GradState.CLOSED
            self._hide_grads()  # the buffer holds reduced slices now, not local gradients
            self.end_pass_without_reduce()
            return
        else:
            if self.optim_pool is Pool.HOST:
                reduced = self._move(reduced, Pool.HOST)
            if state is GradState.STALE:  # the first gradients since zero_grad()
                self.grad_shard.copy_(reduced)
            else:
                self.grad_shard.add_(reduced)
            self.grad_state = GradState.OPEN
        if keep_full:
            assert self.grad_full is not None
            self.grad_full.zero_()
        else:
            self.grad_full = None
        self.end_pass_without_reduce()

    def keep_whole_grads(self) -> None:
        """Stage 0, whose shard is the whole chunk (a shard group of this rank alone): keep
        the gradients in one persistent buffer, in the parameters' dtype, that `.grad` of
        every tensor views, and no optimizer side (see `GradLayout.WHOLE`)."""
        if not self.requires_grad:
            return
        assert self.world_size == 1 and self.keep_gathered, "stage 0 keeps whole chunks"
        assert self.dtypes.reduce == self.dtypes.compute, "`.grad` has its parameter's dtype"
        self.grad_full = torch.zeros(
            self.padded_numel, dtype=self.dtypes.reduce, device=self.device
        )
        self.grad_layout = GradLayout.WHOLE
        self.exposes_grads = True
        # The user's optimizer steps the parameters in place: no master copy, no shard.
        nothing = torch.empty(0, dtype=torch.float32, device=self.device)
        self.grad_shard = nothing
        if self.master is not self.shard:
            self.master = nothing

    def _take_param_grads(self) -> torch.Tensor:
        # A tensor no gradient reached in this pass contributes what its `.grad` holds, as it
        # does to DDP's bucket: zeros once zero_grad() set it to None, the value a user
        # assigned, or (still the view) the sum of the passes before.
        assert self.grad_full is not None
        for info in self.tensors:
            if info.state is TensorState.READY_FOR_REDUCE:
                continue
            target = self.grad_full[info.offset : info.offset + info.numel]
            grad = info.param.grad
            if grad is None:
                target.zero_()
            elif grad.data_ptr() != target.data_ptr():
                target.copy_(grad.reshape(-1))
        return self.grad_full

    def expose_reached_grads(self, reached: list[bool]) -> None:
        """Stage 0, once the average is done: `.grad` of each tensor that some rank's gradient
        reached (`reached`, one flag per tensor, in order) views its part of the buffer; the
        others keep None, as DDP leaves a parameter no rank used."""
        assert self.grad_full is not None
        for info, flag in zip(self.tensors, reached, strict=True):
            if not flag:
                continue
            view = self.grad_full[info.offset : info.offset + info.numel].view(info.shape)
            if info.param.grad is None or info.param.grad.data_ptr() != view.data_ptr():
                info.param.grad = view

    def end_pass_without_reduce(self) -> None:
        """Close a backward pass whose gradients stay unreduced in `grad_full` (no_sync, or
        stage 1), so the next pass counts its gradients afresh."""
        self._initialise_unwritten_grads()
        self.num_grads_ready = 0
        for info in self.tensors:
            if info.state is TensorState.READY_FOR_REDUCE:
                info.state = TensorState.HOLD

    def _initialise_unwritten_grads(self) -> None:
        if self.grad_full is not None and self._grads_written is not None:
            zero_unwritten(self.grad_full, self.tensors, self._grads_written)
        self._grads_written = None  # every element is valid: later gradients add

    def reuse_payload_for_grads(self) -> None:
        """Keep this rank's reduced gradients in the 16-bit payload shard between backward and
        step instead of a persistent fp32 gradient shard (the fp32 master restores the
        parameters at the step). Saves 4 bytes per owned element between steps; refuses
        gradient accumulation, since the next forward would gather gradients as parameters."""
        if not self.requires_grad:
            return
        if self.master is self.shard or self.keep_gathered:
            raise ValueError(
                "reuse_fp16_shard=True needs 16-bit parameters (a separate fp32 master) and "
                "sharded chunks; build the model with ZeroInitContext(default_dtype=torch.float16)"
            )
        assert self.grad_state is not GradState.CLOSED, self.grad_state
        self.grad_layout = GradLayout.IN_PAYLOAD
        self.grad_state = GradState.OPEN
        self.grad_shard = torch.empty(0, dtype=torch.float32, device=self.grad_shard.device)

    def _check_payload_holds_params(self) -> None:
        if self.grad_layout is GradLayout.IN_PAYLOAD and self.grad_state is GradState.CLOSED:
            raise ValueError(_NO_ACCUMULATION)

    def grads_for_step(self) -> torch.Tensor:
        """The fp32 gradient shard the optimizer reads (a transient copy of the payload when
        gradients live there)."""
        if self.grad_layout is GradLayout.IN_PAYLOAD:
            if self.grad_state is GradState.CLOSED:
                self.grad_shard = self.shard.to(torch.float32)
            else:
                self.grad_shard = torch.zeros(
                    self.shard_numel, dtype=torch.float32, device=self.device
                )
            if self.optim_pool is Pool.HOST:
                self.grad_shard = self._move(self.grad_shard, Pool.HOST)
        elif self.grad_state is GradState.STALE:  # no gradient reached it since zero_grad()
            self.grad_shard.zero_()
            self.grad_state = GradState.OPEN
        return self.grad_shard

    def end_step(self) -> None:
        """After a step, taken or skipped: put parameters back into a payload that held
        gradients, and drop the transient gradient copy."""
        if self.grad_layout is GradLayout.IN_PAYLOAD:
            self.shard.copy_(self.master)
            self.grad_state = GradState.OPEN
            self.grad_shard = torch.empty(0, dtype=torch.float32, device=self.grad_shard.device)

    @property
    def grads_cleared(self) -> bool:
        """zero_grad() ran and no gradient reached `grad_shard` since: it holds no gradient,
        whatever its (stale) elements say."""
        return self.grad_state is GradState.STALE

    def zero_grad(self) -> None:
        """Forget the gradients: the next reduced ones overwrite the shard instead of adding to
        it, which spares a pass over it (zeroed at the step if none came)."""
        self.grads_received.clear()
        if self.grad_layout is GradLayout.SLICE_OF_FULL:
            # The next backward adds onto this rank's slice.
            self._hide_grads()
            self.grad_shard.zero_()
            self.grad_state = GradState.OPEN
        elif self.grad_layout is GradLayout.OWN_BUFFER:
            self.grad_state = GradState.STALE
        elif self.grad_layout is GradLayout.WHOLE:
            self._hide_grads()  # the next reduction zeroes what no gradient reaches then
        # IN_PAYLOAD: what the payload holds goes back to parameters at the step (end_step).

    def _hide_grads(self) -> None:
        if self.exposes_grads:
            for info in self.tensors:
                info.compute.grad = None

    def share_grad_shard_with_full(self) -> None:
        """Stage 1: keep the reduced gradient slice the optimizer reads in this rank's own
        slice of the full gradient buffer, which stage 1 keeps anyway, instead of a separate
        fp32 shard: the model state is then the ZeRO formula's. The next backward would add
        onto that slice, so zero_grad() must come between step() and the next backward. Only
        with fp32 reduction (the optimizer reads fp32 gradients)."""
        if not self.requires_grad or not self.keep_gathered or self.dtypes.reduce != torch.float32:
            return
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.device)
        assert self.grad_state is GradState.OPEN, self.grad_state
        self.grad_shard = self.grad_full[self.shard_begin : self.shard_begin + self.shard_numel]
        self.grad_layout = GradLayout.SLICE_OF_FULL
        # `.grad` may show the whole local gradient when the parameters compute in its dtype.
        self.exposes_grads = self.dtypes.compute == torch.float32


_ZERO_GRAD_FIRST = (
    "stage 1 keeps the reduced gradients of the last step in this rank's slice of the "
    "gradient buffer: call optimizer.zero_grad() between step() and the next backward"
)
_NO_ACCUMULATION = (
    "reuse_fp16_shard=True keeps gradients in the parameter shard until step(): call step() "
    "after every backward; for gradient accumulation build ShardedModelV2 with "
    "reuse_fp16_shard=False"
)
