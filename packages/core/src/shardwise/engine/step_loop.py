"""The step's one loop over chunks, whatever tier holds each one's optimizer side.

[Note: the disk tier in the step]
Every chunk steps in one pipelined loop, one at a time (see [Note: the step, chunk by chunk]
in engine/optimizer.py, and [Note: tiers] in chunk/tiers.py): the next chunk's side is fetched
while the current one steps, and the chunk before is sent back meanwhile (at most one in
flight), so three chunks' optimizer sides are in memory at once; each chunk publishes its
parameters before it is sent back. For a side in memory fetching and sending back are nothing;
for one on the disk tier they are a read and a write. The chunks of tiers that can fail (the
disk tier's) step first, and are agreed on by every rank before the others step. A chunk
already in memory (a checkpoint loaded into it since the last step) is not read: its values in
memory are the current ones.

Nothing is lost when a read or write fails (see [Note: the disk tier] in memory/disk_pool.py):
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
from shardwise.comm import CommStats
from shardwise.memory.disk_pool import DiskTierError
from shardwise.memory.pages import give_back_freed_memory


def step_chunks(
    chunks: list[Chunk],
    step_chunk: Callable[[Chunk], None],
    *,
    wait_publish: bool,
    stats: CommStats,
    group: ProcessGroup | None,
) -> None:
    """Step `chunks` (the same chunks in the same order on every rank) as [Note: the disk
    tier in the step] says: those whose tier can fail first, agreed on, then the others.
    `step_chunk` steps one chunk in memory. Raises `DiskTierError` on every rank when any
    rank's disk failed, after rolling back: then no chunk of the other tiers has stepped."""
    fallible = [chunk for chunk in chunks if chunk.tier.fallible]
    if fallible:
        _step_and_agree(fallible, step_chunk, wait_publish=wait_publish, stats=stats, group=group)
    failure, _ = _pipeline(
        [chunk for chunk in chunks if not chunk.tier.fallible], step_chunk, wait_publish
    )
    assert failure is None, failure  # a tier in memory neither reads nor writes


def _pipeline(
    work: list[Chunk],
    step_chunk: Callable[[Chunk], None],
    wait_publish: bool,
    failure: str | None = None,
) -> tuple[str | None, list[Chunk]]:
    """Fetch ahead, step, publish, send back behind, chunk by chunk; where a fetch or send
    fails (or `failure` is given), the chunks after it only issue the collectives their
    publish would. What failed first (None: nothing), and the chunks stepped."""
    stepped: list[Chunk] = []
    reads: dict[int, Future[None]] = {}
    writes: list[Future[None]] = []

    def fetch(position: int) -> str | None:
        chunk = work[position]
        if chunk.optim_side_resident:
            return None  # nothing to read
        try:
            reads[position] = chunk.tier.fetch()
        except (OSError, RuntimeError) as error:
            return f"reading chunk {chunk.chunk_id}: {error}"
        return None

    if failure is None and work:
        failure = fetch(0)
    for position, chunk in enumerate(work):
        if failure is None and position + 1 < len(work):
            failure = fetch(position + 1)  # read ahead
        if failure is None and position in reads:
            failure = _outcome(reads.pop(position), f"reading chunk {chunk.chunk_id}")
        if failure is None:
            step_chunk(chunk)
            chunk.publish_master(wait=wait_publish)
            stepped.append(chunk)
            if writes:  # write behind: the one before must be done before this one queues
                failure = _outcome(writes[-1], f"writing chunk {stepped[-2].chunk_id}")
            writes.append(chunk.tier.evict())
        else:
            chunk.payload.publish_unchanged()
        chunk.grads.end_step()
    for future in reads.values():
        future.exception()  # wait; what it found no longer matters
    for chunk, future in zip(stepped, writes, strict=True):
        failure = failure or _outcome(future, f"writing chunk {chunk.chunk_id}")
    return failure, stepped


def _step_and_agree(
    work: list[Chunk],
    step_chunk: Callable[[Chunk], None],
    *,
    wait_publish: bool,
    stats: CommStats,
    group: ProcessGroup | None,
) -> None:
    """Step the chunks of tiers that can fail, then agree over every rank: commit, or roll
    back and raise `DiskTierError` on every rank."""
    failure: str | None = None
    # Chunks in memory since a checkpoint was loaded into them: their values are the current
    # ones; written (and committed) first, so that a rollback has them on disk.
    unsaved = {id(chunk) for chunk in work if chunk.optim_side_resident}
    for chunk in work:
        if failure is None and id(chunk) in unsaved:
            failure = _outcome(chunk.tier.evict(), f"writing chunk {chunk.chunk_id}")
            if failure is None:
                chunk.tier.commit()
                unsaved.discard(id(chunk))
    failure, stepped = _pipeline(work, step_chunk, wait_publish, failure)
    # What the chunks written out held is free now: back to the system (see [Note: freed
    # memory goes back] in memory/pages.py).
    give_back_freed_memory()
    failures = _agree(failure, stats, group, work[0].device)
    if not failures:
        for chunk in work:
            chunk.tier.commit()
        return
    for chunk in work:
        chunk.tier.rollback()
    lost = _roll_back(work, set(map(id, stepped)), unsaved)
    detail = "; ".join(failures)
    directory = work[0].placement.disk
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


def _agree(
    failure: str | None, stats: CommStats, group: ProcessGroup | None, device: torch.device
) -> list[str]:
    """Every rank's failure, "rank r, <what>", the same list on every rank (empty when none
    failed). One small all-reduce, on the chunks' compute `device` (NCCL moves device tensors
    only); the messages travel only after a failure."""
    flag = torch.tensor([0.0 if failure is None else 1.0], device=device)
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
                chunk.tier.drop()
            chunk.payload.publish_unchanged()
            continue
        try:
            chunk.tier.fetch().result()
        except (OSError, RuntimeError) as error:
            # Its previous copy cannot be read: the parameters published by this step stay.
            lost.append(f"chunk {chunk.chunk_id}, whose previous copy cannot be read ({error})")
            chunk.payload.publish_unchanged()
            continue
        chunk.publish_master(wait=True)
        chunk.tier.drop()
    return "; ".join(lost)
