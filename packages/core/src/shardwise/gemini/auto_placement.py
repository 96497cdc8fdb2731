"""The "auto" policy: chunk shards move between device and host as a traced step demands.

[Note: auto placement]
Every chunk starts with its shard and its optimizer side in host memory. The first forward and
backward are the warm-up: a MemoryTracer samples the non-model bytes at each module boundary
and the order in which boundaries use chunks is recorded. Before each boundary gathers its
chunks, the device must have room for them (and, in backward, their gradient buffers) within
the budget less the non-model bytes traced there; if it has not, shards resident on the device
are sent to host memory, the one used again farthest in the future first (during warm-up, when
the future is unknown, the least recently used first). After a gather, a shard that came from
host memory stays on the device when it fits. At the end of warm-up, `gpu_margin_mem_ratio` of
the room the warm-up left unused goes to optimizer sides on the device (master, gradient shard
and optimizer state, chunk by chunk in chunk order), so those chunks step on the device. Ties
go to the higher chunk id: nothing depends on set or dict iteration order.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from shardwise.chunk import Chunk, ChunkManager, ChunkState, Pool
from shardwise.chunk.accounting import gathered_bytes
from shardwise.gemini.errors import DeviceBudgetExceeded
from shardwise.gemini.tracer import MemoryTracer


class AutoPlacer:
    """Evictions and promotions of chunk shards for the "auto" policy.

    Args:
        chunk_manager: the chunks.
        budget: device bytes allowed, model state and non-model memory together.
        margin_ratio: share of the room left after warm-up given to optimizer sides.
        device_bytes: the model-state bytes on the device now.
        tracer: the non-model memory sampler.
    """

    def __init__(
        self,
        chunk_manager: ChunkManager,
        *,
        budget: int,
        margin_ratio: float,
        device_bytes: Callable[[], int],
        tracer: MemoryTracer,
    ) -> None:
        self.chunk_manager = chunk_manager
        self.budget = budget
        self.margin_ratio = margin_ratio
        self._device_bytes = device_bytes
        self.tracer = tracer
        self.warm = False
        self.timeline: list[tuple[int, ...]] = []
        self.non_model: list[int] = []
        self.warmup_peak = 0
        self.evictions = 0
        self._position = 0
        self._last_use: dict[int, int] = {}
        self._uses: dict[int, list[int]] = {}

    def begin_step(self) -> None:
        self._position = 0

    def non_model_now(self) -> int:
        if not self.warm:
            return self.tracer.sample()
        position = min(self._position - 1, len(self.non_model) - 1)
        return self.non_model[max(position, 0)] if self.non_model else 0

    def before_gather(self, chunks: list[Chunk], backward: bool) -> None:
        """Make room on the device for `chunks` (see [Note: auto placement])."""
        position = self._position
        self._position += 1
        ids = tuple(c.chunk_id for c in chunks)
        if not self.warm:
            self.timeline.append(ids)
            self.non_model.append(self.tracer.sample())
        for chunk_id in ids:
            self._last_use[chunk_id] = position
        need = sum(gathered_bytes(c) for c in chunks if c.state is ChunkState.SHARDED)
        if backward:
            # Their gradient buffers arrive during this backward step.
            need += sum(
                c.padded_numel * _reduce_size(c)
                for c in chunks
                if c.requires_grad and c.grad_full is None
            )
        room = self.budget - self.non_model_now()
        while self._device_bytes() + need > room:
            victim = self._victim(set(ids), position)
            if victim is None:
                short = self._device_bytes() + need - room
                raise DeviceBudgetExceeded(
                    f"placement 'auto' cannot fit: at boundary {position} the device needs "
                    f"{need} bytes for chunks {list(ids)} beside {self._device_bytes()} bytes of "
                    f"model state and {self.non_model_now()} of non-model memory, {short} bytes "
                    f"more than the budget of {self.budget}; a device_budget_bytes of at least "
                    f"{self.budget + short}, or a smaller chunk_size_numel, would fit"
                )
            victim.move_payload(Pool.HOST)
            self.evictions += 1

    def after_gather(self, chunks: list[Chunk]) -> None:
        """Keep a shard that came from host memory on the device when it fits."""
        room = self.budget - self.non_model_now()
        for chunk in chunks:
            if chunk.payload_pool is Pool.HOST and not chunk.keep_gathered:
                shard_bytes = chunk.shard.numel() * chunk.shard.element_size()
                if self._device_bytes() + shard_bytes <= room:
                    chunk.move_payload(Pool.DEVICE)

    def _victim(self, needed: set[int], position: int) -> Chunk | None:
        candidates = [
            c
            for c in self.chunk_manager.chunks
            if c.payload_pool is Pool.DEVICE
            and not c.keep_gathered
            and c.state is ChunkState.SHARDED
            and c.chunk_id not in needed
        ]
        if not candidates:
            return None
        if not self.warm:
            return min(candidates, key=lambda c: (self._last_use.get(c.chunk_id, -1), -c.chunk_id))
        return max(candidates, key=lambda c: (self._distance(c.chunk_id, position), c.chunk_id))

    def _distance(self, chunk_id: int, position: int) -> int:
        uses = self._uses.get(chunk_id, [])
        if not uses:
            return 1 << 62
        later = bisect.bisect_right(uses, position)
        if later < len(uses):
            return uses[later] - position
        return uses[0] + len(self.timeline) - position

    def end_warmup(
        self,
        peak_device_bytes: int,
        move_optim: Callable[[Chunk], None],
        optim_bytes: Callable[[Chunk], int],
    ) -> None:
        """Fix the timeline and give the margin to optimizer sides on the device."""
        self.warm = True
        self.tracer.stop()
        for position, ids in enumerate(self.timeline):
            for chunk_id in ids:
                self._uses.setdefault(chunk_id, []).append(position)
        self.warmup_peak = peak_device_bytes
        margin = int(self.margin_ratio * max(0, self.budget - peak_device_bytes))
        for chunk in self.chunk_manager.chunks:
            if not chunk.requires_grad or chunk.optim_pool is Pool.DEVICE:
                continue
            # fp32 master and gradient shard, and the optimizer's state (Adam's two moments
            # when it has none yet).
            side = chunk.master.numel() * 4 * 2 + (optim_bytes(chunk) or chunk.master.numel() * 8)
            if side > margin:
                break
            margin -= side
            move_optim(chunk)


def _reduce_size(chunk: Chunk) -> int:
    return chunk.grad_shard.new_empty((), dtype=chunk.dtypes.reduce).element_size()
