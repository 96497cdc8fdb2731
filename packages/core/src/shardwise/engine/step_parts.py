"""What an optimizer's step uses of its model, handed over once, when the optimizer is built.

The step reduces what backward left, checks the ranks agree, computes the global norm in one
all-reduce, steps and publishes. It used to reach each of these through the model's
collaborators (`model.reducer`, `model.config.topology.process_group`,
`model.chunk_manager.topology.replicas`, ...) at every step; the model now gives them as one
value (`step_parts(model)`), built after its chunks are packed, when they stop changing:
an optimizer is wrapped over a packed model, and a model re-packed or released afterwards can
no longer be stepped by it anyway (see ZeroModel.configure_reduction and release_module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup

from shardwise.comm import CommStats
from shardwise.gemini import GeminiManager
from shardwise.runtime.grad_reducer import GradReducer
from shardwise.runtime.rank_sync import RankSync
from shardwise.runtime.runtime import Runtime

if TYPE_CHECKING:  # the model module builds on this one's callers, not on it
    from shardwise.engine.model import ZeroModel


@dataclass(frozen=True, kw_only=True, slots=True)
class StepParts:
    """The model's parts an optimizer step uses.

    Attributes:
        runtime: runs the model's passes; settles a backward that raised before the step,
            forgets it at `zero_grad()` (see [Note: the phase of the pass] in
            runtime/phase.py).
        reducer: reduces what backward left, before the step reads the gradient shards.
        rank_sync: the ranks' pass checks, whose signature rides in the norm's all-reduce.
        comm_stats: where the step's collectives are counted.
        process_group: the group the norm is all-reduced over (every rank of the model).
        data_parallel: every rank training the model (the disk tier's agreement on failures).
        device: the compute device, where the norm's all-reduce travels.
        replicas: how many ranks hold each shard (hybrid sharding), dividing their sums.
        defers_param_gather: the all-gather of updated parameters runs into the next forward
            instead of being waited for in the step.
        gemini: the memory manager ("auto" placement plans again after an overrun), if any.
    """

    runtime: Runtime
    reducer: GradReducer
    rank_sync: RankSync
    comm_stats: CommStats
    process_group: ProcessGroup | None
    data_parallel: ProcessGroup | None
    device: torch.device
    replicas: int
    defers_param_gather: bool
    gemini: GeminiManager | None


def step_parts(model: ZeroModel) -> StepParts:
    """What an optimizer's step uses of `model`, its chunks packed first (`model.reducer`
    packs them)."""
    runtime = model.runtime
    topology = model.chunk_manager.topology
    return StepParts(
        runtime=runtime,
        reducer=runtime.reducer,
        rank_sync=model.rank_sync,
        comm_stats=model.comm_stats,
        process_group=model.config.topology.process_group,
        data_parallel=topology.data_parallel,
        device=model.config.device,
        replicas=topology.replicas,
        defers_param_gather=model.config.defers_param_gather,
        gemini=model.gemini_manager,
    )
