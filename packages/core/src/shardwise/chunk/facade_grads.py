"""The gradient layouts of one facade each (see [Note: gradient layouts] in grads.py):
`InPayloadGrads` for `ShardedModelV2(reuse_fp16_shard=True)`, `WholeGrads` for stage 0
(`ColoDDP`). The engine's stages 1-3 never build them."""

from __future__ import annotations

import torch

from shardwise.chunk.grads import GradSide, OwningChunk, ViewedGrads, no_shard
from shardwise.chunk.states import GradLayout, GradState, Pool


class InPayloadGrads(GradSide):
    """`reuse_fp16_shard`: this rank's reduced gradients live in the 16-bit payload shard
    between backward and step instead of a persistent fp32 gradient shard (the fp32 master
    restores the parameters at the step). Saves 4 bytes per owned element between steps;
    refuses gradient accumulation, since the next forward would gather gradients as
    parameters (see [Note: gradient layouts])."""

    layout = GradLayout.IN_PAYLOAD
    STATES = frozenset({GradState.OPEN, GradState.CLOSED})

    def __init__(self, chunk: OwningChunk) -> None:
        if chunk.master is chunk.payload.shard or chunk.keep_gathered:
            raise ValueError(
                "reuse_fp16_shard=True needs 16-bit parameters (a separate fp32 master) and "
                "sharded chunks; build the model with ZeroInitContext(default_dtype=torch.float16)"
            )
        super().__init__(chunk, no_shard(chunk))

    def _take_reduced(self, reduced: torch.Tensor) -> None:
        if self.state is GradState.CLOSED:
            raise ValueError(_NO_ACCUMULATION)
        self._chunk.payload.shard.copy_(reduced)
        self._enter(GradState.CLOSED, GradState.OPEN)

    def check_payload_holds_params(self) -> None:
        if self.state is GradState.CLOSED:
            raise ValueError(_NO_ACCUMULATION)

    def for_step(self) -> torch.Tensor:
        """A transient fp32 copy of the payload's gradients (zeros when none arrived)."""
        chunk = self._chunk
        if self.state is GradState.CLOSED:
            self.shard = chunk.payload.shard.to(torch.float32)
        else:
            self.shard = torch.zeros(chunk.shard_numel, dtype=torch.float32, device=chunk.device)
        if chunk.placement.optim is not Pool.DEVICE:
            self.shard = chunk.placement.move_to(self.shard, Pool.HOST)
        return self.shard

    def end_step(self) -> None:
        """Put the parameters back into the payload and drop the transient gradient copy."""
        chunk = self._chunk
        chunk.payload.shard.copy_(chunk.master)
        self._enter(GradState.OPEN)
        self.shard = no_shard(chunk)


class WholeGrads(ViewedGrads):
    """Stage 0, whose shard is the whole chunk (a shard group of this rank alone): the
    gradients stay in one persistent buffer, in the parameters' dtype, that `.grad` of every
    tensor views, and there is no optimizer side (see [Note: gradient layouts])."""

    layout = GradLayout.WHOLE
    STATES = frozenset({GradState.OPEN})

    def __init__(self, chunk: OwningChunk) -> None:
        assert chunk.world_size == 1 and chunk.keep_gathered, "stage 0 keeps whole chunks"
        assert chunk.dtypes.reduce == chunk.dtypes.compute, "`.grad` has its parameter's dtype"
        full = torch.zeros(chunk.padded_numel, dtype=chunk.dtypes.reduce, device=chunk.device)
        super().__init__(chunk, no_shard(chunk), full)
        self.exposes = True

    def prepare_reduce(self) -> torch.Tensor:
        self._contribute_what_grad_holds()
        assert self.full is not None
        return self.full

    def accept_reduced(self, reduced: torch.Tensor, *, keep_full: bool) -> None:
        """The buffer was averaged in place and stays, whatever `keep_full` says: `.grad`
        views it."""
        self.end_pass()

    def zero_grad(self) -> None:
        """The next reduction zeroes what no gradient reaches then."""
        super().zero_grad()


_NO_ACCUMULATION = (
    "reuse_fp16_shard=True keeps gradients in the parameter shard until step(): call step() "
    "after every backward; for gradient accumulation build ShardedModelV2 with "
    "reuse_fp16_shard=False"
)


__all__ = ["InPayloadGrads", "WholeGrads"]
