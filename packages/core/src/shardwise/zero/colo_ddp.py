"""ColoDDP: plain data parallelism (every rank holds the whole model) as the chunk engine's
stage 0: chunks as DDP's buckets, averaged across ranks during backward, `.grad` viewing them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.modules.module import _IncompatibleKeys

from shardwise import comm
from shardwise.comm import CommStats
from shardwise.engine.build import chunk_manager_for
from shardwise.engine.config import Chunking, EngineConfig, MixedPrecision, Topology
from shardwise.engine.model import _WRAPPED_MARK
from shardwise.prepare.ignore import is_ignored, mark_ignored
from shardwise.runtime.grad_reducer import GradReducer


class ColoDDP(nn.Module):
    """Replicated data parallelism on the chunk engine, with torch DDP's semantics.

    The parameters are packed into chunks of about `bucket_cap_mb`, each a DDP bucket, kept
    whole on every rank (stage 0: a shard group of one rank, every other rank a replica; see
    [Note: stage 0] in chunk/reduction.py); packing starts every rank from rank 0's values,
    and buffers are broadcast from rank 0 too. During backward each chunk is averaged over the
    ranks in one all-reduce as soon as its gradients are complete, in the same order on every
    rank, and `.grad` of each parameter is a view into its chunk's gradient buffer (DDP's
    `gradient_as_bucket_view`). As DDP with `find_unused_parameters=True`: a parameter used on
    some ranks only gets the average, the others contributing zeros; one no rank used keeps
    `.grad` None; backward passes without `zero_grad()` between add up. Step a plain torch
    optimizer over `model.parameters()`. Call `model.backward(loss)` or `loss.backward()`.
    `state_dict()`, `load_state_dict()`, `named_parameters()` and `named_buffers()` speak the
    inner module's names (no `module.` prefix), as ColossalAI's ColoDDP does, so a state dict
    moves between the wrapped and the plain model unchanged.

    Args:
        module: the model; its parameters (not those `set_params_to_ignore` marked) become
            views into chunks and must share one floating dtype and one device.
        process_group: the data-parallel group; None means the default group.
        bucket_cap_mb: chunk capacity in MiB (a larger parameter gets a chunk of its own).
        rebuild_bucket: after the first backward, reduce the chunks in the order they
            completed there (rank 0's), so the first reduced are the first complete; with
            False they keep reverse packing order. Which parameters share a chunk is fixed at
            wrap time (parameter order, which backward meets in reverse).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: ProcessGroup | None = None,
        bucket_cap_mb: float = 25,
        rebuild_bucket: bool = True,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if any(getattr(m, _WRAPPED_MARK, False) for m in module.modules()):
            raise ValueError(
                f"{type(module).__name__} is or holds a module already wrapped by shardwise: "
                f"its parameters are views into chunks already. Wrap the plain module once"
            )
        if (
            isinstance(bucket_cap_mb, bool)
            or not isinstance(bucket_cap_mb, (int, float))
            or bucket_cap_mb <= 0
        ):
            raise ValueError(f"bucket_cap_mb must be a number > 0, got {bucket_cap_mb!r}")
        comm.check_launched_group(process_group)
        named = [(name, p) for name, p in module.named_parameters() if not is_ignored(p)]
        dtype, device = _dtype_and_device(named)
        super().__init__()
        comm.destroy_default_group_at_exit()  # see [Note: gloo at exit] in comm/lifecycle.py
        object.__setattr__(module, _WRAPPED_MARK, True)
        self.module = module
        self.process_group = process_group
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.rebuild_bucket = rebuild_bucket
        self.comm_stats = CommStats()
        # Stage 0 of the one engine configuration: whole chunks of the parameters' dtype,
        # every rank a replica (see [Note: one configuration] in zero/front_door.py).
        self.config = EngineConfig(
            stage=0,
            device=device,
            precision=MixedPrecision(param_dtype=dtype),
            chunking=Chunking(size_numel=max(1, self.bucket_cap_bytes // dtype.itemsize)),
            topology=Topology(process_group=process_group),
        )
        self.chunk_manager = chunk_manager_for(self.config, self.comm_stats)
        # Closing each chunk broadcasts rank 0's values into it.
        self.chunk_manager.register(named)
        self._chunks = list(self.chunk_manager.trainable_chunks())
        for chunk in self._chunks:
            chunk.keep_whole_grads()
        with torch.no_grad():
            for buffer in module.buffers():
                comm.broadcast(buffer.data, 0, self.comm_stats, process_group)
        # Each synchronised backward ends by showing `.grad` of every parameter some rank's
        # gradient reached (one all-reduce of flags), as DDP with find_unused_parameters=True.
        self.reducer = GradReducer(
            self.chunk_manager,
            reduce_in_backward=True,
            overlap=True,  # every chunk's all-reduce runs while backward goes on
            learn_order=rebuild_bucket,
        )

    @staticmethod
    def set_params_to_ignore(params_to_ignore: Iterable[torch.Tensor]) -> None:
        """Exclude these parameters from broadcast and reduction (call before wrapping): they
        keep their own values and local gradients on each rank (see [Note: ignored
        parameters] in prepare/ignore.py).

        Args:
            params_to_ignore: the parameters to leave alone.
        """
        mark_ignored(params_to_ignore)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # A backward that raised is ended first, as DDP users skip a bad batch (see [Note: the
        # phase of the pass] in runtime/phase.py).
        self.reducer.settle()
        return self.module(*args, **kwargs)

    # ---- the inner module's names ------------------------------------------------------------

    def state_dict(  # type: ignore[override]
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The inner module's state dict, under its own names (every rank holds it whole)."""
        if destination is None:
            return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load a state dict with the inner module's names into the chunks (in place); every
        rank loads the same one. Returns (missing_keys, unexpected_keys)."""
        if assign:
            raise ValueError("assign=True cannot be honoured: parameters are views of chunks")
        result: _IncompatibleKeys = self.module.load_state_dict(state_dict, strict=strict)
        return result

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, unaveraged, in the backward passes run inside, as
        DDP's `no_sync()`: no collective runs there and `.grad` holds this rank's own sum; the
        next backward outside averages everything accumulated since `zero_grad()`. Run the
        forward inside too, as DDP needs (here the backward alone decides)."""
        with self.reducer.unsynced():
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`; gradients are averaged over ranks when it returns."""
        loss.backward()

    def extra_repr(self) -> str:
        manager = self.chunk_manager
        return f"chunks={len(manager.chunks)}, bucket_cap_bytes={self.bucket_cap_bytes}"


def _dtype_and_device(named: list[tuple[str, nn.Parameter]]) -> tuple[torch.dtype, torch.device]:
    """The one floating dtype and device the parameters share (a chunk holds one dtype)."""
    if not named:
        return torch.float32, torch.device("cpu")
    kinds = {(p.dtype, p.device) for _, p in named}
    if len(kinds) > 1 or not named[0][1].is_floating_point():
        seen = ", ".join(sorted(f"{dtype} on {device}" for dtype, device in kinds))
        raise ValueError(
            f"ColoDDP packs parameters into chunks of one floating dtype on one device, got "
            f"{seen}: cast or move the module first, or leave the odd ones out with "
            f"ColoDDP.set_params_to_ignore"
        )
    dtype = named[0][1].dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"ColoDDP's chunks hold fp32, fp16 or bf16 parameters (the engine's dtypes), got "
            f"{dtype}: cast the module first, e.g. module.float()"
        )
    return dtype, named[0][1].device
