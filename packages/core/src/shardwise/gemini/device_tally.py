"""Running totals of the device bytes a model's chunks hold, kept up to date chunk by chunk.

[Note: device tally]
The memory manager checks the device's bytes after every gather and gradient copy. Summing
every chunk each time made 3,800 chunk counts per step under "auto" on a model of 40 small
chunks. Instead each chunk reports a change of its buffers (see [Note:
resident changes] in chunk/resident.py) to this tally, which recounts only the chunks that
changed since the last question and keeps the totals. Of a changed chunk it recounts only the
transient buffers when only those changed: the buffers it keeps between steps (shard, master,
gradient shard) change only by assignment, and counting them at every gather made a placement
that keeps them on the device cost more bookkeeping per step than one that keeps them in host
memory. A chunk's optimizer state (in its optim pool) is one of those: the chunk reports it as
a resident change when the step makes or replaces it (see [Note: the chunk owns its optimizer
state] in chunk/optimizer_state.py).
"""

from __future__ import annotations

from shardwise.chunk import Chunk, ChunkManager, Pool
from shardwise.chunk.accounting import resting_device_bytes, transient_bytes


class DeviceTally:
    """The device bytes of `chunk_manager`'s chunks: model state (optimizer state included)
    and the transient part of it (gathered payloads and gradient buffers).

    Args:
        chunk_manager: the chunks to count; chunks packed later are picked up when asked.
    """

    def __init__(self, chunk_manager: ChunkManager) -> None:
        self.chunk_manager = chunk_manager
        self._watched: list[Chunk] = []
        # Per chunk id: (its model-state device bytes, their transient part) when last counted.
        self._counted: dict[int, tuple[int, int]] = {}
        # Per chunk id: the device bytes it keeps between steps (optimizer state included).
        self._resting: dict[int, int] = {}
        self._dirty: dict[int, Chunk] = {}
        self._model = 0
        self._transient = 0

    def device_bytes(self) -> int:
        """Model-state bytes on the device now."""
        self._settle()
        return self._model

    def transient_bytes(self) -> int:
        """Bytes of gathered payloads and gradient buffers on the device now."""
        self._settle()
        return self._transient

    def chunk_device_bytes(self, chunk: Chunk) -> int:
        """Model-state bytes `chunk` holds on the device now."""
        self._check_held(chunk)
        self._settle()
        return self._counted[chunk.chunk_id][0]

    def resident_changed(self, chunk: Chunk, transient: bool) -> None:
        """A watched chunk's buffers changed (see [Note: resident changes] in
        chunk/resident.py): count it again when next asked."""
        self._dirty[chunk.chunk_id] = chunk
        if not transient:
            self._resting.pop(chunk.chunk_id, None)

    def _check_held(self, chunk: Chunk) -> None:
        # Chunks are filed by id: another manager's chunk would stand in for this one's.
        chunks = self.chunk_manager.chunks
        if not (chunk.chunk_id < len(chunks) and chunks[chunk.chunk_id] is chunk):
            raise ValueError(
                f"chunk {chunk.chunk_id} is not one of this tally's chunk manager's "
                f"({len(chunks)} chunks); ask the memory manager that placed it"
            )

    def _settle(self) -> None:
        chunks = self.chunk_manager.chunks
        if len(chunks) != len(self._watched):  # a manager's chunk list only grows
            self._watch(chunks)
        for chunk in self._dirty.values():
            model, transient = self._count(chunk)
            old_model, old_transient = self._counted.get(chunk.chunk_id, (0, 0))
            self._model += model - old_model
            self._transient += transient - old_transient
            self._counted[chunk.chunk_id] = (model, transient)
        self._dirty.clear()

    def _watch(self, chunks: list[Chunk]) -> None:
        """Start over on the chunks packed so far."""
        for chunk in self._watched:
            chunk.resident_watch = None
        self._watched = list(chunks)
        self._counted.clear()
        self._resting.clear()
        self._model = self._transient = 0
        for chunk in chunks:
            chunk.resident_watch = self
        self._dirty = {chunk.chunk_id: chunk for chunk in chunks}

    def _count(self, chunk: Chunk) -> tuple[int, int]:
        transient = transient_bytes(chunk)
        resting = self._resting.get(chunk.chunk_id)
        if resting is None:
            resting = self._resting[chunk.chunk_id] = self._count_resting(chunk)
        return transient + resting, transient

    def _count_resting(self, chunk: Chunk) -> int:
        held = resting_device_bytes(chunk)
        if chunk.placement.optim is Pool.DEVICE:
            held += chunk.optimizer_state.nbytes()
        return held
