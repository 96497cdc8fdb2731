"""The chunks each gather unit's call of a pass needed, recorded once and replayed after (see
[Note: recorded execution order] in runtime/gather_scheduler.py)."""

from __future__ import annotations

# How many unit calls ahead a prefetch looks for the next chunk the pass needs.
_LOOKAHEAD = 256


class PassTrace:
    """The chunk ids each module call needed, in order, with replay bookkeeping."""

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth  # chunks a prefetch looks for ahead
        self.steps: list[tuple[int, ...]] = []
        self.recorded = False
        self.position = 0
        self.on_track = True
        self._ahead: list[tuple[int, ...]] = []

    def begin(self) -> None:
        self.position = 0
        self.on_track = self.recorded

    def visit(self, chunk_ids: tuple[int, ...]) -> None:
        if not self.recorded:
            self.steps.append(chunk_ids)
        elif self.on_track and (
            self.position >= len(self.steps) or self.steps[self.position] != chunk_ids
        ):
            self.on_track = False
        self.position += 1

    def upcoming(self) -> tuple[int, ...]:
        """The chunks the pass needs next, beyond those of the module call just visited."""
        if self.on_track and 0 < self.position <= len(self._ahead):
            return self._ahead[self.position - 1]
        return ()

    def finish(self) -> None:
        if not self.recorded and self.steps:
            self.recorded = True
            self._ahead = [self._next_new_chunks(p) for p in range(len(self.steps))]

    def _next_new_chunks(self, position: int) -> tuple[int, ...]:
        # A run of module calls over the same chunks (the blocks packed in one chunk) would
        # give the next chunk's gather only the run's last call to hide behind: look past it.
        # The chunks come in order of first use, whole calls at a time, until `depth` are found.
        current = set(self.steps[position])
        found: list[int] = []
        for later in self.steps[position + 1 : position + 1 + _LOOKAHEAD]:
            found += [c for c in dict.fromkeys(later) if c not in current and c not in found]
            if len(found) >= self.depth:
                break
        return tuple(found)


__all__ = ["PassTrace"]
