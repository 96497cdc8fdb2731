"""The side-stream paths of the copy path and the gathers (see [Note: streams and events] in
memory/streams.py), run on this CPU host with streams that only record what is asked of them:
each path's sequence of copies, staging and landings runs as on CUDA, where the events order
it, and a run through them must train exactly as a run without streams. On CUDA,
tests/gpu/test_cuda.py compares the two with real streams.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, adamw, batch_slice, make_model, max_abs_diff

import shardwise.engine.build as build
from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.memory import Memory, PinnedBuffers, Streams
from shardwise.testing import run_ranks


class RecordedEvent:
    def __init__(self, log: list[str], stream: str) -> None:
        self.log, self.stream = log, stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.append(f"host waits {self.stream}")


class RecordingStreams(Streams):
    """Streams as the engine sees them on CUDA; on a CPU every operation runs at once, so
    what they order is already in order: they record the requests."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, enabled=False)
        self.enabled = True
        self.gather, self.reduce, self.copy = "gather", "reduce", "copy"
        self.log: list[str] = []
        self._current = "compute"

    def on(self, stream: Any) -> Any:
        return nullcontext()

    def record(self, stream: Any = None) -> Any:
        return RecordedEvent(self.log, stream or "compute")

    def wait(self, event: Any, stream: Any = None) -> None:
        if event is not None:
            self.log.append(f"{stream or 'compute'} waits {event.stream}")


class NoPinning:
    def pin(self, storage: torch.UntypedStorage) -> None:
        pass

    def unpin(self, storage: torch.UntypedStorage) -> None:
        pass


def _train(
    stage: int, options: dict[str, Any], optim_config: dict[str, Any] | None, streams: bool
) -> tuple[list[float], dict[str, torch.Tensor], set[str]]:
    rank = dist.get_rank()
    recording = RecordingStreams(torch.device("cpu"))
    if streams:
        build.memory_for = lambda config: Memory(  # type: ignore[assignment]
            config.device, pinned=PinnedBuffers(NoPinning()), streams=recording
        )
    model = make_model()
    config = {
        "device": torch.device("cpu"),
        "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, compute_dtype=torch.float32),
        **options,
    }
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped, adamw(model.parameters()), max_norm=1.0, optim_config=optim_config
    )
    losses = []
    for step in range(3):
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, 2))
        optimizer.backward(loss)
        total = loss.detach().float()
        dist.all_reduce(total)
        optimizer.step()
        losses.append(float(total / 2))
    return losses, wrapped.state_dict(only_rank_0=False), set(recording.log)


@pytest.mark.parametrize(
    ("stage", "options", "optim_config", "expected"),
    [
        # Host shards gathered on the gather stream after the compute queued before, the
        # compute waiting for the gather; gradients leave on the copy stream after their
        # reduction and land on the host at the step.
        (
            3,
            {"placement_policy": "cpu"},
            None,
            {
                "gather waits compute",
                "compute waits gather",
                "copy waits compute",
                "host waits copy",
            },
        ),
        # Optimizer sides on the host, payloads on the device: gradients leave and parameters
        # go up (from pinned staging) on the copy stream. (Here the "device" is the host, so
        # the upload's wait is the host's; on CUDA it is the compute stream's.)
        (
            2,
            {},
            {"cpu_offload": True, "reduce_bucket_size": CHUNK_NUMEL},
            {"copy waits compute", "host waits copy"},
        ),
    ],
    ids=["stage3-cpu", "stage2-offload"],
)
def test_the_stream_paths_train_exactly_as_without_streams(
    stage: int, options: dict[str, Any], optim_config: dict[str, Any] | None, expected: set[str]
) -> None:
    plain = run_ranks(_train, 2, stage, options, optim_config, False)
    streamed = run_ranks(_train, 2, stage, options, optim_config, True)
    for (losses, state, _), (s_losses, s_state, log) in zip(plain, streamed, strict=True):
        assert s_losses == losses
        assert max_abs_diff(s_state, state) == 0.0
        assert expected <= log, log
