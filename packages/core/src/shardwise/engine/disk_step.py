"""The step of the chunks whose optimizer side is on the disk tier.

[Note: the disk tier in the step]
The chunks on the disk tier step first, one at a time (see [Note: the step, chunk by chunk] in
engine/optimizer.py): the next chunk's master and state are read in while the current one
steps, and the chunk before is written out meanwhile (at most one write in flight), so three
chunks' optimizer sides are in memory at once. Each chunk publishes its parameters before it
is written out. A chunk already in memory (a checkpoint loaded into it since the last step) is
not read: its values in memory are the current ones.

Nothing is lost when a read or write fails (see [Note: the disk tier] in chunk/disk_pool.py):
the rank that saw it stops stepping but keeps issuing the collectives the others issue (stages
1-2 all-gather each published chunk); then every rank says, in one all-reduce, whether it
failed. If none did, the copies written become the current ones and the chunks in memory step
as usual. If any did, every rank rolls its disk chunks back: what was written is discarded;
a chunk stepped on this rank reads its previous copy back and publishes it again (so the
parameters are as before the step), a chunk not stepped frees what was read of it; the
optimizer's scalar state (step counts) and the loss scaler are restored by the caller; and
every rank raises the same `DiskTierError`, naming each failing rank and what failed. The
chunks in memory have not stepped by then, so the model and optimizer are as they were before
the step. The gradients of that step are left as they were (unscaled where a chunk stepped):
call `zero_grad()` before the next backward.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch.distributed import ProcessGroup, ReduceOp

from shardwise import comm
from shardwise.chunk import Chunk
from shardwise.chunk.disk_pool import DiskTierError
from shardwise.comm import CommStats
from shardwise.memory.pages import give_back_freed_memory


def step_on_disk(
    work: list[tuple[Chunk, torch.Tensor]],
    step_chunk: Callable[[Chunk, torch.Tensor], None],
    *,
    wait_publish: bool,
    stats: CommStats,
    group: ProcessGroup | None,
) -> None:
    """Step the disk tier's chunks (`work`: each chunk with its gradient shard, the same
    chunks in the same order on every rank) as [Note: the disk tier in the step] says.
    `step_chunk` steps one chunk in memory. Raises `DiskTierError` on every rank when any
    rank's disk failed, after rolling back."""
    failure: str | None = None
    stepped: list[Chunk] = []
    reads: dict[int, Future[None]] = {}
    writes: list[Future[None]] = []
    # Chunks in memory since a checkpoint was loaded into them: their values are the current
    # ones; written (and committed) first, so that a rollback has them on disk.
    unsaved = {id(chunk) for chunk, _ in work if chunk.optim_side_resident}
    for chunk, _ in work:
        if failure is None and id(chunk) in unsaved:
            failure = _outcome(chunk.start_evict(), f"writing chunk {chunk.chunk_id}")
            if failure is None:
                chunk.commit_disk()
                unsaved.discard(id(chunk))

    def fetch(position: int) -> str | None:
        chunk = work[position][0]
        try:
            reads[position] = chunk.start_fetch()
        except (OSError, RuntimeError) as error:
            return f"reading chunk {chunk.chunk_id}: {error}"
        return None

    if failure is None and work:
        failure = fetch(0)
    for position, (chunk, grad) in enumerate(work):
        if failure is None and position + 1 < len(work):
            failure = fetch(position + 1)  # read ahead
        if failure is None:
            failure = _outcome(reads.pop(position), f"reading chunk {chunk.chunk_id}")
        if failure is None:
            step_chunk(chunk, grad)
            chunk.publish_master(wait=wait_publish)
            stepped.append(chunk)
            if writes:  # write behind: the one before must be done before this one queues
                failure = _outcome(writes[-1], f"writing chunk {stepped[-2].chunk_id}")
            writes.append(chunk.start_evict())
        else:
            chunk.payload.publish_unchanged()
        chunk.grads.end_step()
    for future in reads.values():
        future.exception()  # wait; what it found no longer matters
    for chunk, future in zip(stepped, writes, strict=True):
        failure = failure or _outcome(future, f"writing chunk {chunk.chunk_id}")
    # What the chunks written out held is free now: back to the system (see [Note: freed
    # memory goes back] in memory/pages.py).
    give_back_freed_memory()
    failures = _agree(failure, stats, group)
    if not failures:
        for chunk, _ in work:
            chunk.commit_disk()
        return
    for chunk, _ in work:
        chunk.discard_disk()
    lost = _roll_back([chunk for chunk, _ in work], set(map(id, stepped)), unsaved)
    detail = "; ".join(failures)
    directory = work[0][0].placement.disk
    raise DiskTierError(
        f"the disk tier failed ({detail}); the step was rolled back on every rank: the model "
        f"and optimizer are as they were before it"
        + (f", except {lost}" if lost else "")
        + " (call zero_grad() before the next backward). Check the free space and permissions "
        f"of {directory.path.parent if directory is not None else 'the disk tier directory'}"
    )


def _outcome(future: Future[None], what: str) -> str | None:
    error = future.exception()
    return None if error is None else f"{what}: {error}"


def _agree(failure: str | None, stats: CommStats, group: ProcessGroup | None) -> list[str]:
    """Every rank's failure, "rank r, <what>", the same list on every rank (empty when none
    failed). One small all-reduce; the messages travel only after a failure."""
    flag = torch.tensor([0.0 if failure is None else 1.0])
    comm.all_reduce(flag, stats, group, op=ReduceOp.MAX)
    if flag.item() == 0:
        return []
    said = comm.all_gather_object(failure, stats, group)
    return [f"rank {rank}, {what}" for rank, what in enumerate(said) if what is not None]


def _roll_back(chunks: list[Chunk], stepped: set[int], unsaved: set[int]) -> str:
    """Put every chunk back as its current disk copy has it (a chunk whose loaded values were
    never written keeps them in memory); what could not be, described."""
    lost = []
    for chunk in chunks:
        if id(chunk) in unsaved:
            chunk.payload.publish_unchanged()
            continue
        if id(chunk) not in stepped:
            if chunk.optim_side_resident:
                chunk.drop_fetched()
            chunk.payload.publish_unchanged()
            continue
        try:
            chunk.start_fetch().result()
        except (OSError, RuntimeError) as error:
            # Its previous copy cannot be read: the parameters published by this step stay.
            lost.append(f"chunk {chunk.chunk_id}, whose previous copy cannot be read ({error})")
            chunk.payload.publish_unchanged()
            continue
        chunk.publish_master(wait=True)
        chunk.drop_fetched()
    return "; ".join(lost)
