"""Training through the pooled pinned path (see [Note: pinned buffers, pooled] in
memory/pinned.py) on 2 ranks, on this CPU host: the engine's memory is given a pool of pinned
buffers whose pinner only records (the pool's logic is the same over cudaHostRegister), and
every buffer the pool hands out, new or reused, is filled with NaN first, so a read of one
before it is written would reach the losses and weights. Stage 3 with every chunk's shard and
optimizer side in host memory ("cpu"), stage 2 with ColossalAI's `cpu_offload`, two
micro-batches a step (the second backward's reduced gradients reach the host as temporaries
added into the shards): each against the same run with plain host buffers, bit for bit, and
with nothing pinned after the first step (later steps' copies reuse its buffers). The pinner
refuses what cudaHostRegister refuses (zero bytes); a run with every optimizer side on the
disk tier (which frees what it writes, so a pooled buffer larger than its master must not be
what it writes) trains the same; and a dropped model leaves nothing pinned.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, adamw, batch_slice, make_model, max_abs_diff

import shardwise.engine.build as build
from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.memory import Memory, PinnedBuffers
from shardwise.testing import run_ranks

STEPS = 4


class RecordingPinner:
    """Pins nothing (there is no CUDA here); counts, and refuses what cudaHostRegister
    refuses (a registration of zero bytes, one of memory already registered)."""

    def __init__(self) -> None:
        self.pins = 0
        self.pinned: dict[int, int] = {}  # address -> bytes

    @property
    def pinned_bytes(self) -> int:
        return sum(self.pinned.values())

    def pin(self, storage: torch.UntypedStorage) -> None:
        if storage.nbytes() == 0:
            raise RuntimeError("cudaHostRegister of 0 bytes: cudaErrorInvalidValue")
        if storage.data_ptr() in self.pinned:
            raise RuntimeError("cudaHostRegister: cudaErrorHostMemoryAlreadyRegistered")
        self.pins += 1
        self.pinned[storage.data_ptr()] = storage.nbytes()

    def unpin(self, storage: torch.UntypedStorage) -> None:
        self.pinned.pop(storage.data_ptr())


class PoisonedPinnedBuffers(PinnedBuffers):
    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = super().empty(numel, dtype)
        torch.tensor([], dtype=torch.uint8).set_(tensor.untyped_storage()).fill_(0xFF)
        return tensor


def _train(
    stage: int, pinned: bool, disk: str | None = None
) -> tuple[list[float], dict[str, torch.Tensor], list[int], int]:
    """Losses, final weights and the pins counted after each step; then the bytes still
    pinned once the model and its optimizer are dropped."""
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
        if disk is not None:
            config.update(nvme_offload_fraction=1.0, nvme_offload_dir=f"{disk}/rank{rank}")
            # Payloads in bf16: the fp32 masters are buffers of their own, from the pool.
            config["mixed_precision"] = MixedPrecision(
                param_dtype=torch.bfloat16, compute_dtype=torch.float32
            )
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
    state = {name: value.clone() for name, value in wrapped.state_dict(only_rank_0=False).items()}
    optimizer.close()
    del wrapped, optimizer, model
    gc.collect()
    return losses, state, pins, pinner.pinned_bytes


@pytest.mark.parametrize("stage", [2, 3])
def test_pooled_pinned_host_buffers_train_bit_for_bit_and_pin_once(stage: int) -> None:
    plain = run_ranks(_train, 2, stage, False)
    pooled = run_ranks(_train, 2, stage, True)
    for (losses, state, *_), (pooled_losses, pooled_state, pins, left) in zip(
        plain, pooled, strict=True
    ):
        assert pooled_losses == losses
        assert max_abs_diff(pooled_state, state) == 0.0
        assert pins[0] > 0  # host buffers came from the pool
        assert pins[1:] == [pins[0]] * (STEPS - 1)  # and later steps pinned nothing
        assert left == 0  # the dropped model's pool unpinned every buffer
    assert losses[-1] < losses[0]


def test_the_disk_tier_trains_over_pooled_pinned_buffers(tmp_path: Path) -> None:
    # Masters placed in host memory come from the pool, at their size class: the disk tier
    # writes copies of their own size, and frees those, never a pooled buffer.
    plain = run_ranks(_train, 2, 3, False, str(tmp_path / "plain"))
    pooled = run_ranks(_train, 2, 3, True, str(tmp_path / "pooled"))
    for (losses, state, *_), (pooled_losses, pooled_state, pins, left) in zip(
        plain, pooled, strict=True
    ):
        assert pooled_losses == losses
        assert max_abs_diff(pooled_state, state) == 0.0
        assert pins[0] > 0 and left == 0
