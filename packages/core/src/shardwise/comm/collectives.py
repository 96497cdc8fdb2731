"""Stateless wrappers over torch.distributed collectives that count what they send.

They never see modules or chunks: callers pass flat tensors and a process group, and get back
the torch `Work` handle when `async_op=True`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from shardwise.comm.stats import CommOp, CommStats


def world_size(group: ProcessGroup | None = None) -> int:
    """Ranks in `group`, or 1 when torch.distributed is not initialised (single process)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group`, or 0 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    stats: CommStats,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    kind: CommOp = CommOp.ALL_GATHER,
    unquantized_payload_bytes: int | None = None,
) -> dist.Work | None:
    """Gather every rank's `shard` into `output` (shard numel x world size), in rank order,
    counted as `kind`; a quantized gather names the payload the unquantized one would gather
    (see [Note: unquantized bytes] in comm/stats.py)."""
    n = world_size(group)
    payload = _nbytes(output)
    stats.record(kind, payload, payload * (n - 1) // n, _unquantized(unquantized_payload_bytes, n))
    if n == 1:
        output.copy_(shard)
        return None
    work: dist.Work | None = dist.all_gather_single(output, shard, group=group, async_op=async_op)
    return work


def reduce_scatter(
    shard_out: torch.Tensor,
    full: torch.Tensor,
    stats: CommStats,
    group: ProcessGroup | None = None,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce `full` over ranks with `op`; rank r receives the r-th slice in `shard_out`."""
    n = world_size(group)
    payload = _nbytes(full)
    stats.record(CommOp.REDUCE_SCATTER, payload, payload * (n - 1) // n)
    if n == 1:
        shard_out.copy_(full)
        return None
    work: dist.Work | None = dist.reduce_scatter_single(
        shard_out, full, op=op, group=group, async_op=async_op
    )
    return work


def all_reduce(
    tensor: torch.Tensor,
    stats: CommStats,
    group: ProcessGroup | None = None,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    async_op: bool = False,
    kind: CommOp = CommOp.ALL_REDUCE,
) -> dist.Work | None:
    """Reduce `tensor` in place over ranks with `op`, counted as `kind`."""
    n = world_size(group)
    payload = _nbytes(tensor)
    stats.record(kind, payload, 2 * payload * (n - 1) // n)
    if n == 1:
        return None
    work: dist.Work | None = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return work


def broadcast(
    tensor: torch.Tensor,
    src_rank: int,
    stats: CommStats,
    group: ProcessGroup | None = None,
) -> None:
    """Copy `tensor` from group rank `src_rank` to every rank, in place."""
    n = world_size(group)
    payload = _nbytes(tensor)
    sent = payload if rank(group) == src_rank and n > 1 else 0
    stats.record(CommOp.BROADCAST, payload, sent)
    if n == 1:
        return
    dist.broadcast(tensor, group=group, group_src=src_rank)


class Waitable(Protocol):
    """What an asynchronous collective returns: `wait()` blocks until its output is valid."""

    def wait(self) -> bool: ...


class _Messages:
    """The point-to-point messages of one `gather_pieces`, with the tensors they read and
    write kept alive until `wait()`."""

    def __init__(self, works: list[dist.Work], tensors: list[torch.Tensor]) -> None:
        self._works = works
        self._tensors = tensors

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        self._works, self._tensors = [], []
        return True


def gather_pieces(
    receives: Sequence[tuple[int, torch.Tensor]],
    sends: Sequence[torch.Tensor],
    dst_rank: int,
    stats: CommStats,
    group: ProcessGroup | None = None,
    *,
    logical_bytes: int,
) -> Waitable:
    """Gather to group rank `dst_rank` by point-to-point messages: there, each buffer of
    `receives` (source rank, buffer) is filled with the next tensor that source sends; every
    other rank sends `sends` to `dst_rank`, in order. Messages between two ranks are matched
    in the order they are posted, so both sides list the pieces in the same order. Tensors
    and buffers are contiguous and of any sizes: the receiver names where each piece lands
    (views into tensors of its own), so nothing is gathered into one buffer to be copied out.
    Counted as GATHER with `logical_bytes` as its payload (the whole that `dst_rank` holds
    after) and the bytes this rank sent. Returns the handle of the posted messages: call
    `wait()` before reading the buffers or reusing the tensors sent."""
    me = rank(group)
    if me == dst_rank and sends:
        raise ValueError(f"rank {me} receives this gather: it has nothing to send")
    if me != dst_rank and receives:
        raise ValueError(f"rank {me} sends in this gather to rank {dst_rank}: it receives nothing")
    stats.record(CommOp.GATHER, logical_bytes, sum(_nbytes(t) for t in sends))
    works: list[dist.Work] = []
    for source, buffer in receives:
        work = dist.irecv(buffer, group=group, group_src=source)
        assert work is not None
        works.append(work)
    for tensor in sends:
        work = dist.isend(tensor, group=group, group_dst=dst_rank)
        assert work is not None
        works.append(work)
    return _Messages(works, [*sends, *(buffer for _, buffer in receives)])


class ReduceScatterMethod(str, Enum):
    """How a buffer reduced over ranks reaches each rank as its own slice.

    [Note: reduce-scatter methods]
    The ZeRO analysis counts a reduce-scatter, (N-1)/N of the buffer sent per rank. gloo's own
    reduce-scatter runs at a fraction of its all-reduce's speed, yet its all-to-all moves the
    same bytes as a reduce-scatter faster than either (5.3M fp32 values on 2 ranks here:
    all-to-all plus the local sum 11 ms, all-reduce 15 ms, reduce-scatter 25 to 50 ms; see
    benchmarks/RESULTS.md). So on gloo the slices are exchanged with an all-to-all and summed
    locally, in rank order; NCCL's reduce-scatter is used as it is.
    """

    NATIVE = "reduce_scatter"
    """torch.distributed's reduce-scatter."""
    ALL_TO_ALL = "all_to_all"
    """Each rank sends every other rank that rank's slice, then sums the N slices it received,
    in rank order (with 2 ranks, bit-identical to any sum of the two, so the one slice
    received is added to this rank's own in place: a receive buffer of one slice, not N)."""
    ALL_REDUCE = "all_reduce"
    """The whole buffer is all-reduced in place and each rank keeps its slice: twice the
    bytes; kept for comparison and for backends without the other two."""


class _SumOnWait:
    """The pending all-to-all of a reduce-scatter: waiting sums the received slices."""

    def __init__(self, work: dist.Work, received: torch.Tensor, out: torch.Tensor) -> None:
        self._work = work
        self._received = received  # (N, shard numel): row r is rank r's contribution
        self._out = out

    def wait(self) -> bool:
        self._work.wait()
        torch.sum(self._received, dim=0, out=self._out)
        return True


Allocate = Callable[[int, torch.dtype], torch.Tensor]
"""Makes a receive buffer of so many elements of a dtype (the caller's, who owns it)."""


def reduce_to_shard(
    full: torch.Tensor,
    method: ReduceScatterMethod,
    stats: CommStats,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    allocate: Allocate | None = None,
) -> tuple[Waitable | None, torch.Tensor]:
    """Sum `full` over ranks so that rank r holds the r-th of N equal slices of the result.

    Returns (handle, slice): with `async_op`, the slice is valid after `handle.wait()`; without,
    the handle is None and the slice is ready. The slice may be a view of `full` (ALL_REDUCE),
    which then holds reduced values. See [Note: reduce-scatter methods]. Receive buffers come
    from `allocate` (default: new tensors on `full`'s device).
    """
    if allocate is None:
        allocate = _allocator(full.device)
    n = world_size(group)
    if full.numel() % n:
        raise ValueError(f"a buffer of {full.numel()} elements does not split over {n} ranks")
    shard_numel = full.numel() // n
    if method is ReduceScatterMethod.ALL_REDUCE:
        begin = rank(group) * shard_numel
        work = all_reduce(full, stats, group, async_op=async_op)
        return work, full[begin : begin + shard_numel]
    if method is ReduceScatterMethod.NATIVE:
        reduced = allocate(shard_numel, full.dtype)
        return reduce_scatter(reduced, full, stats, group, async_op=async_op), reduced
    payload = _nbytes(full)
    stats.record(CommOp.REDUCE_SCATTER, payload, payload * (n - 1) // n)
    if n == 1:
        return None, full.clone()
    if n == 2:
        return _exchange_with_peer(full, shard_numel, group, async_op, allocate)
    reduced = allocate(shard_numel, full.dtype)
    received = allocate(full.numel(), full.dtype)
    exchange = dist.all_to_all_single(received, full, group=group, async_op=True)
    pending = _SumOnWait(exchange, received.view(n, shard_numel), reduced)
    if async_op:
        return pending, reduced
    pending.wait()
    return None, reduced


class _AddOnWait:
    """The pending exchange of a two-rank reduce-scatter: waiting adds this rank's own slice
    to the peer's, received in place."""

    def __init__(self, work: dist.Work, own: torch.Tensor, received: torch.Tensor) -> None:
        self._work = work
        self._own = own
        self._received = received

    def wait(self) -> bool:
        self._work.wait()
        self._received.add_(self._own)
        return True


def _exchange_with_peer(
    full: torch.Tensor,
    shard_numel: int,
    group: ProcessGroup | None,
    async_op: bool,
    allocate: Allocate,
) -> tuple[Waitable | None, torch.Tensor]:
    """Two ranks: each sends the peer its slice and receives the peer's part of its own, into
    a buffer of one slice that then holds the sum (a + b rounds as the sum of the two rows
    does, in every dtype), instead of receiving a whole buffer (see [Note: reduce-scatter
    methods])."""
    me = rank(group)
    peer = 1 - me
    received = allocate(shard_numel, full.dtype)
    splits = [0, shard_numel] if me == 0 else [shard_numel, 0]
    exchange = dist.all_to_all_single(
        received,
        full[peer * shard_numel : (peer + 1) * shard_numel],
        output_split_sizes=splits,
        input_split_sizes=splits,
        group=group,
        async_op=True,
    )
    pending = _AddOnWait(exchange, full[me * shard_numel : (me + 1) * shard_numel], received)
    if async_op:
        return pending, received
    pending.wait()
    return None, received


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    stats: CommStats,
    group: ProcessGroup | None = None,
    *,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    logical_bytes: int,
    kind: CommOp = CommOp.REDUCE_SCATTER,
    async_op: bool = False,
    unquantized_payload_bytes: int | None = None,
) -> dist.Work | None:
    """Send rank d the d-th split of `input` and receive rank r's split for this rank as the
    r-th split of `output` (equal splits unless given), counted as `kind` with
    `logical_bytes` as its payload: the whole buffer the exchange stands for (a
    reduce-scatter's input), of which a rank sends (N-1)/N; a quantized exchange names the
    buffer the unquantized reduce-scatter would reduce (see [Note: unquantized bytes] in
    comm/stats.py)."""
    n = world_size(group)
    stats.record(
        kind,
        logical_bytes,
        logical_bytes * (n - 1) // n,
        _unquantized(unquantized_payload_bytes, n),
    )
    if n == 1:
        output.copy_(input)
        return None
    work: dist.Work | None = dist.all_to_all_single(
        output,
        input,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
        async_op=async_op,
    )
    return work


def _unquantized(payload_bytes: int | None, n: int) -> int | None:
    """What a rank sends of an unquantized all-gather or reduce-scatter of `payload_bytes`."""
    return None if payload_bytes is None else payload_bytes * (n - 1) // n


def _allocator(device: torch.device) -> Allocate:
    def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    return allocate
