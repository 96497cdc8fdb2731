"""Training through the pooled pinned path (see [Note: pinned buffers, pooled] in
memory/pinned.py) on 2 ranks, on this CPU host: the engine's memory is given a pool of pinned
buffers whose pinner only records (the pool's logic is the same over cudaHostRegister), and
every buffer the pool hands out, new or reused, is filled with NaN first, so a read of one
before it is written would reach the losses and weights. Stage 3 with every chunk's shard and
optimizer side in host memory ("cpu"), stage 2 with ColossalAI's `cpu_offload`, two
micro-batches a step (the second backward's reduced gradients reach the host as temporaries
added into the shards): each against the same run with plain host buffers, bit for bit, and
with nothing pinned after the first step (later steps' copies reuse its buffers).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, adamw, batch_slice, make_model, max_abs_diff

import shardwise.engine.build as build
from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.memory import Memory, PinnedBuffers
from shardwise.testing import run_ranks

STEPS = 4


class RecordingPinner:
    """Pins nothing (there is no CUDA here); counts, and poisons what it is given."""

    def __init__(self) -> None:
        self.pins = 0
        self.pinned_bytes = 0

    def pin(self, storage: torch.UntypedStorage) -> None:
        self.pins += 1
        self.pinned_bytes += storage.nbytes()

    def unpin(self, storage: torch.UntypedStorage) -> None:
        self.pinned_bytes -= storage.nbytes()


class PoisonedPinnedBuffers(PinnedBuffers):
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = super().empty(numel, dtype)
        torch.tensor([], dtype=torch.uint8).set_(tensor.untyped_storage()).fill_(0xFF)
        return tensor


def _train(stage: int, pinned: bool) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
    rank = dist.get_rank()
    pinner = RecordingPinner()
    if pinned:
        # The engine's memory for this model, with the recording pool (see memory_for).
        build.memory_for = lambda config: Memory(  # type: ignore[assignment]
            config.device, pinned=PoisonedPinnedBuffers(pinner)
        )
    model = make_model()
    config: dict[str, Any] = {"device": torch.device("cpu")}
    optim_config: dict[str, Any] | None = None
    if stage == 3:
        config.update(chunk_size_numel=CHUNK_NUMEL, placement_policy="cpu")
    else:
        optim_config = {"reduce_bucket_size": CHUNK_NUMEL, "cpu_offload": True}
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped, adamw(model.parameters()), max_norm=1.0, optim_config=optim_config
    )
    losses, pins = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        total = torch.zeros(())
        for micro in range(2):
            loss = wrapped(*batch_slice(step, micro, rank, 2)) / 2
            optimizer.backward(loss)
            total += loss.detach().float()
        dist.all_reduce(total)
        optimizer.step()
        losses.append(float(total / 2))
        pins.append(pinner.pins)
    return losses, wrapped.state_dict(only_rank_0=False), pins


@pytest.mark.parametrize("stage", [2, 3])
def test_pooled_pinned_host_buffers_train_bit_for_bit_and_pin_once(stage: int) -> None:
    plain = run_ranks(_train, 2, stage, False)
    pooled = run_ranks(_train, 2, stage, True)
    for (losses, state, _), (pooled_losses, pooled_state, pins) in zip(plain, pooled, strict=True):
        assert pooled_losses == losses
        assert max_abs_diff(pooled_state, state) == 0.0
        assert pins[0] > 0  # host buffers came from the pool
        assert pins[1:] == [pins[0]] * (STEPS - 1)  # and later steps pinned nothing
    assert losses[-1] < losses[0]
