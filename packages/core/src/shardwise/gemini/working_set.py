"""The working set against a device budget, for the placements that move everything else.

[Note: the working set and the budget]
Under "auto" and "cpu" placement whatever a step keeps on the device between uses can wait in
host memory; what cannot is the working set: the chunks gathered at once (whole, so larger
than their shards) and the gradient buffers of the chunks computing. A budget below it cannot
train, and a budget an error names must then pass the whole step, forward, backward and the
optimizer's step. So:
- The chunk size does not depend on the budget (engine/build.py searches it without one):
  a budget the error names keeps the chunks it was measured with.
- The first forward and backward (the warm-up) run to their end even where the working set
  passes the budget (the device holds more than the budget meanwhile), recording its peak and
  the chunks held at every point. At the end of the warm-up the ranks agree on the peak, and
  where it passes the budget every rank raises alike, naming it: a budget that passes (the
  steps after the warm-up hold no more, since they prefetch only where the budget has room
  for it), whether it exceeds the model state a rank keeps (gathered chunks are whole, the
  state is sharded), and the largest chunk size whose working set would fit the budget,
  estimated from the recorded points (see [Note: the working set at another chunk size] in
  chunk/working_set.py), or that none would.
- After the warm-up a check that fails raises at once, with the same figures.
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.chunk import Chunk, ChunkManager
from shardwise.chunk.accounting import gathered_bytes, transient_bytes
from shardwise.chunk.working_set import largest_fitting_chunk_size
from shardwise.gemini.errors import DeviceBudgetExceeded


class WorkingSetGuard:
    """Records stage 3's working set during the warm-up and raises, once every rank knows it
    passes the budget (see [Note: the working set and the budget]).

    Args:
        chunk_manager: the chunks.
        budget: the device budget in bytes.
        policy: the placement's name, for messages.
    """

    def __init__(self, chunk_manager: ChunkManager, budget: int, policy: str) -> None:
        self.chunk_manager = chunk_manager
        self.budget = budget
        self.policy = policy
        self.warm = False
        self.peak = 0
        self.first_over: str | None = None
        # The ids of the chunks holding transient buffers at each point of the warm-up.
        self.held: set[tuple[int, ...]] = set()
        # Whether a prefetch (and a chunk kept from forward into backward) has room beside the
        # working set: decided at the end of the warm-up, off before.
        self.prefetch_fits = False

    def observe(self, transient: int, where: str) -> None:
        """A check during the step: record the working set now and the chunks holding it."""
        if self.warm:
            return
        self.peak = max(self.peak, transient)
        chunks = self.chunk_manager.chunks
        self.held.add(tuple(c.chunk_id for c in chunks if transient_bytes(c) > 0))
        if transient > self.budget and self.first_over is None:
            self.first_over = where

    def over_budget(self, device: int, where: str, model_state: int) -> None:
        """The device holds `device` bytes, over the budget, with nothing left to move: carry
        on during the warm-up (it raises at its end), raise after it."""
        if not self.warm:
            if self.first_over is None:
                self.first_over = where
            return
        raise self._error(max(self.peak, device), where, model_state)

    def end_warmup(self, agree_max: Callable[[int], int], model_state: int) -> None:
        """The warm-up's backward ended on this rank: agree with every rank on the working
        set's peak (a collective); raise on every rank alike when it passes the budget."""
        self.warm = True
        peak = agree_max(self.peak)
        chunks = self.chunk_manager.chunks
        largest = max((gathered_bytes(c) for c in chunks if not c.keep_gathered), default=0)
        largest_grads = max((_grad_bytes(c) for c in chunks if c.requires_grad), default=0)
        # As "auto" reserves it (see [Note: auto placement]): a prefetched chunk, one kept from
        # forward into backward, and the gradient buffer a backward prefetch brings on.
        self.prefetch_fits = peak + 2 * largest + largest_grads <= self.budget
        if peak > self.budget:
            raise self._error(peak, self.first_over or "during the first step", model_state)

    def _error(self, peak: int, where: str, model_state: int) -> DeviceBudgetExceeded:
        chunks = self.chunk_manager.chunks
        size = self.chunk_manager.chunk_size_numel
        message = (
            f"placement {self.policy!r} cannot train within device_budget_bytes="
            f"{self.budget} (first passed {where}): the step's working set, the chunks "
            f"gathered at once and the gradient buffers of those computing, which no "
            f"placement can move to host memory, takes {peak} bytes of the device with chunks "
            f"of {size} elements"
        )
        if peak > model_state:
            message += (
                f", more than the whole model state a rank keeps ({model_state} bytes before "
                f"optimizer state): gathered chunks are whole where the state is sharded"
            )
        message += (
            f". device_budget_bytes={peak} passes the whole step (the chunk size does not "
            f"depend on the budget)"
        )
        fitting = largest_fitting_chunk_size(chunks, sorted(self.held), self.budget, size)
        if fitting is not None:
            fit_size, estimate = fitting
            message += (
                f"; or, within this budget, chunk_size_numel={fit_size} (a working set of about "
                f"{estimate} bytes)"
            )
        else:
            message += (
                "; no chunk size would fit this budget: the largest tensors, each a chunk of its "
                "own, are gathered together"
            )
        return DeviceBudgetExceeded(message)


def _grad_bytes(chunk: Chunk) -> int:
    return (
        chunk.padded_numel
        * chunk.grads.shard.new_empty((), dtype=chunk.dtypes.reduce).element_size()
    )
