"""The state machines of a chunk and of each tensor it holds, and what a chunk records of
each tensor and its dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn


class ChunkState(Enum):
    """Whether a chunk's whole payload is materialised on this rank."""

    SHARDED = "sharded"
    """Only this rank's shard of the payload is allocated; the full buffer's storage is
    resized to zero and the parameters that view it must not be read."""
    GATHERED = "gathered"
    """The full payload is allocated and valid on this rank; parameters view it."""


class TensorState(Enum):
    """Where one tensor of a chunk is in the life of a training step."""

    FREE = "free"
    """The chunk is sharded: the tensor has no data on this rank."""
    HOLD = "hold"
    """The chunk is gathered and the tensor's data is valid, but no op is using it now."""
    COMPUTE = "compute"
    """A forward or backward op of the module owning the tensor is running; its chunk must
    stay gathered."""
    READY_FOR_REDUCE = "ready_for_reduce"
    """This backward pass's gradient for the tensor is complete and has been copied into the
    chunk's gradient buffer; the chunk is reduced once all its trainable tensors are here."""


class GradLayout(Enum):
    """Where a chunk keeps the reduced gradient shard the optimizer reads; fixed before the
    first backward."""

    OWN_BUFFER = "own_buffer"
    """An fp32 buffer of its own (`grads.shard`), into which each reduction adds."""
    SLICE_OF_FULL = "slice_of_full"
    """Stage 1 with fp32 reduction where `.grad` shows nothing (16-bit compute, or hybrid
    sharding): this rank's own slice of the whole local gradient buffer (`grads.full`), which
    stage 1 keeps anyway; the reduction at the step writes the reduced slice there."""
    AVERAGED_FULL = "averaged_full"
    """Stage 1 with fp32 compute and reduction: the whole gradient buffer (`grads.full`),
    averaged over the ranks in place during each synchronised backward (an all-reduce, as
    DDP's) and viewed by `.grad`; the optimizer reads this rank's own slice of it."""
    IN_PAYLOAD = "in_payload"
    """`reuse_fp16_shard`: the 16-bit payload shard holds the reduced gradient between
    backward and step, the fp32 master restoring the parameters at the step."""
    WHOLE = "whole"
    """Stage 0 (`ColoDDP`: a shard group of this rank alone, every other rank a replica): no
    shard; the whole gradient buffer, in the parameters' dtype, is averaged across the
    replicas in place after each backward and `.grad` of every tensor views it, as DDP's
    `gradient_as_bucket_view`; later passes add onto it as they add onto `.grad`. No
    `grads.shard`: the user's optimizer reads `.grad` (see [Note: stage 0] in
    chunk/reduction.py)."""


class GradState(Enum):
    """What the gradient shard holds in a training step."""

    STALE = "stale"
    """`zero_grad()` ran and no reduced gradient arrived since: the shard's elements are
    leftovers, overwritten by the next reduction or zeroed at the step (`OWN_BUFFER`)."""
    OPEN = "open"
    """Gradients may arrive: the shard holds the reduced sum so far (`OWN_BUFFER`, zeros
    included), the local gradients accumulate unreduced (`SLICE_OF_FULL`), `grads.full` holds
    the averages of the synchronised passes plus the local gradients since (`AVERAGED_FULL`),
    or the payload holds parameters (`IN_PAYLOAD`)."""
    CLOSED = "closed"
    """Reduced in place, so no gradient may be added before the step or `zero_grad()`: this
    rank's slice of `grads.full` holds the reduced gradient and the rest is zero
    (`SLICE_OF_FULL`), the step has read (and unscaled or clipped in place) this rank's slice
    of the averaged buffer (`AVERAGED_FULL`), or the payload holds the gradient instead of
    parameters (`IN_PAYLOAD`)."""


class Pool(Enum):
    """The pools a chunk's buffers are placed in: two of memory, and the disk tier."""

    DEVICE = "device"
    """The compute device: cuda:<i>, or the CPU itself on a host without GPUs (where the pools
    are the same memory but are still accounted apart, so placement logic runs everywhere)."""
    HOST = "host"
    """Host memory (pinned when the compute device is CUDA and pinning is asked for)."""
    DISK = "disk"
    """Files under a directory the user names, for an optimizer side only: the fp32 master and
    the optimizer state, read into host memory for the chunk's step and written back after
    (its gradient shard stays in host memory). See [Note: the disk tier] in memory/disk_pool.py."""


@dataclass(slots=True)
class TensorInfo:
    """Where one parameter lives inside its chunk."""

    name: str
    param: nn.Parameter  # the object the model was built with (optimizers and users hold it)
    offset: int  # first element in the chunk's full buffer
    numel: int
    shape: torch.Size
    state: TensorState
    # The parameter forward and backward compute with, whose gradient autograd accumulates:
    # `param` itself, or its compute face once its chunk is sharded (see [Note: two faces of
    # a stage-3 parameter] in chunk/parameters.py).
    compute: nn.Parameter


@dataclass(frozen=True, slots=True)
class ChunkDtypes:
    """Dtypes of a chunk's buffers: storage and gathers, compute, gradient reduction."""

    payload: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
