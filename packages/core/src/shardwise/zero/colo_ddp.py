"""ColoDDP: plain data parallelism (every rank holds the whole model), gradients all-reduced
in buckets at the end of backward."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.modules.module import _IncompatibleKeys

from shardwise import comm
from shardwise.comm import CommStats
from shardwise.zero.ignore import is_ignored, mark_ignored


class ColoDDP(nn.Module):
    """Replicated data parallelism with bucketed gradient all-reduce.

    Parameters are broadcast from rank 0 at wrap time. After each backward, gradients are
    averaged over ranks in buckets of about `bucket_cap_mb`; a parameter that got no gradient
    on some rank contributes zeros there (so ranks never disagree on the collectives), and ends
    with a gradient on every rank. Call `model.backward(loss)` or plain `loss.backward()`.
    `state_dict()`, `load_state_dict()`, `named_parameters()` and `named_buffers()` speak the
    inner module's names (no `module.` prefix), as ColossalAI's ColoDDP does, so a state dict
    moves between the wrapped and the plain model unchanged.

    Args:
        module: the model.
        process_group: the data-parallel group; None means the default group.
        bucket_cap_mb: bucket size in MiB.
        rebuild_bucket: after the first backward, order the buckets as gradients became ready
            then (so the first buckets reduced are the first ones complete).
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
        if isinstance(module, ColoDDP):
            raise ValueError("nested ColoDDP is not supported: wrap the inner module once")
        if (
            isinstance(bucket_cap_mb, bool)
            or not isinstance(bucket_cap_mb, (int, float))
            or bucket_cap_mb <= 0
        ):
            raise ValueError(f"bucket_cap_mb must be a number > 0, got {bucket_cap_mb!r}")
        super().__init__()
        comm.destroy_default_group_at_exit()  # see [Note: gloo at exit] in comm/lifecycle.py
        self.module = module
        self.process_group = process_group
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.rebuild_bucket = rebuild_bucket
        self.comm_stats = CommStats()
        self._params = [p for p in dict.fromkeys(module.parameters()) if not is_ignored(p)]
        self._ready_order: list[nn.Parameter] = []
        self._buckets = self._make_buckets(self._params)
        self._rebuilt = not rebuild_bucket
        self._queued = False
        with torch.no_grad():
            for tensor in [*self._params, *module.buffers()]:
                comm.broadcast(tensor.data, 0, self.comm_stats, process_group)
        for param in self._params:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._on_grad)

    @staticmethod
    def set_params_to_ignore(params_to_ignore: Iterable[torch.Tensor]) -> None:
        """Exclude these parameters from broadcast and reduction (call before wrapping): they
        keep their own values and local gradients on each rank (see [Note: ignored
        parameters] in zero/ignore.py).

        Args:
            params_to_ignore: the parameters to leave alone.
        """
        mark_ignored(params_to_ignore)

    def _make_buckets(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for param in params:
            if not param.requires_grad:
                continue
            nbytes = param.numel() * param.element_size()
            if buckets[-1] and size + nbytes > self.bucket_cap_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(param)
            size += nbytes
        return [bucket for bucket in buckets if bucket]

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._rebuilt:
            self._ready_order.append(param)
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce_all)

    def _reduce_all(self) -> None:
        self._queued = False
        world = comm.world_size(self.process_group)
        for bucket in self._buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch._utils._flatten_dense_tensors(grads)
            comm.all_reduce(flat, self.comm_stats, self.process_group)
            if world > 1:
                flat.div_(world)
            for param, reduced in zip(
                bucket, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
            ):
                if param.grad is None:
                    param.grad = reduced
                else:
                    param.grad.copy_(reduced)
        if not self._rebuilt:
            self._rebuild_buckets()

    def _rebuild_buckets(self) -> None:
        # Readiness order can differ between ranks (a branch used on one rank only), and
        # buckets must be the same everywhere: rank 0's order is broadcast.
        trainable = [p for p in self._params if p.requires_grad]
        position = {id(p): i for i, p in enumerate(trainable)}
        ready = [position[id(p)] for p in dict.fromkeys(self._ready_order)]
        rest = [i for i in range(len(trainable)) if i not in set(ready)]
        # On the parameters' device: NCCL only moves device tensors.
        order = torch.tensor(ready + rest, dtype=torch.int64, device=trainable[0].device)
        comm.broadcast(order, 0, self.comm_stats, self.process_group)
        self._buckets = self._make_buckets([trainable[i] for i in order.tolist()])
        self._rebuilt = True
        self._ready_order.clear()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
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
        """Load a state dict with the inner module's names; every rank loads the same one.
        Returns (missing_keys, unexpected_keys)."""
        result: _IncompatibleKeys = self.module.load_state_dict(
            state_dict, strict=strict, assign=assign
        )
        return result

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`; gradients are averaged over ranks when it returns."""
        loss.backward()
