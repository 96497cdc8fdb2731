"""How a chunk's payload travels in an all-gather and becomes what the parameters compute with.

[Note: gather codecs]
Every all-gather of a chunk's payload (stage 3 before a module runs, stages 1-2 after the step)
goes through `Chunk._start_all_gather`: the codec encodes this rank's shard into what is sent,
and once the gathered buffer is complete decodes it into the compute buffer the parameters
view. Today there are two: `IdentityCodec` (the payload is sent as stored and the parameters
view it), and `CastCodec` (the payload is sent as stored and cast into a compute copy, for a
16-bit payload computed in fp32). A codec that sends fewer bits than the payload holds (a
quantised gather) is a third class here, not a flag in the chunk.
"""

from __future__ import annotations

from typing import Protocol

import torch

from shardwise.chunk.states import ChunkDtypes


class GatherCodec(Protocol):
    """The two ends of a chunk's all-gather."""

    @property
    def needs_compute_copy(self) -> bool:
        """Whether the parameters view a buffer of their own, filled by `decode`."""
        ...

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        """What this rank sends for `shard` (the gathered buffer's dtype)."""
        ...

    def decode(self, gathered: torch.Tensor, compute: torch.Tensor | None) -> None:
        """Fill the compute buffer from the gathered one (nothing to do when they are one)."""
        ...


class IdentityCodec:
    """The payload is sent as stored and computed with in place."""

    needs_compute_copy = False

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        return shard

    def decode(self, gathered: torch.Tensor, compute: torch.Tensor | None) -> None:
        assert compute is None, "an identity gather has no compute copy"


class CastCodec:
    """The payload is sent as stored and cast into a compute copy of `compute_dtype`."""

    needs_compute_copy = True

    def __init__(self, compute_dtype: torch.dtype) -> None:
        self.compute_dtype = compute_dtype

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        return shard

    def decode(self, gathered: torch.Tensor, compute: torch.Tensor | None) -> None:
        assert compute is not None and compute.dtype == self.compute_dtype
        compute.copy_(gathered)


def codec_for(dtypes: ChunkDtypes) -> GatherCodec:
    """The codec of a chunk with these dtypes."""
    if dtypes.compute == dtypes.payload:
        return IdentityCodec()
    return CastCodec(dtypes.compute)
