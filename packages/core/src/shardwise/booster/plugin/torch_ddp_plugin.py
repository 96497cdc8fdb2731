"""TorchDDPPlugin: torch's DistributedDataParallel with ColossalAI's `TorchDDPPlugin`
arguments."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from shardwise.booster.plugin.plugin_base import Boosted, DPPluginBase
from shardwise.booster.plugin.refusals import refuse_model_parallel
from shardwise.engine.config import default_device
from shardwise.interface import ModelWrapper, OptimizerWrapper


class TorchDDPModel(ModelWrapper):
    """A model boosted by TorchDDPPlugin: `module` is the DistributedDataParallel around the
    user's module, which `unwrap()` returns."""

    def __init__(self, module: nn.Module, **ddp_kwargs: Any) -> None:
        super().__init__(DistributedDataParallel(module, **ddp_kwargs))

    def unwrap(self) -> nn.Module:
        ddp = self.module
        assert isinstance(ddp, DistributedDataParallel)
        inner: nn.Module = ddp.module
        return inner


class TorchDDPPlugin(DPPluginBase):
    """torch DDP with ColossalAI 0.5's `TorchDDPPlugin` arguments, passed to
    `DistributedDataParallel` as they are. On CUDA batch norms become `SyncBatchNorm`, as in
    ColossalAI. `fp8_communication` is refused.

    Args: broadcast_buffers, bucket_cap_mb, find_unused_parameters, check_reduction,
        gradient_as_bucket_view, static_graph: DistributedDataParallel's.
    """

    def __init__(
        self,
        broadcast_buffers: bool = True,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        fp8_communication: bool = False,
    ) -> None:
        super().__init__()
        refuse_model_parallel(type(self).__name__, fp8_communication=fp8_communication)
        self.ddp_kwargs = {
            "broadcast_buffers": broadcast_buffers,
            "bucket_cap_mb": bucket_cap_mb,
            "find_unused_parameters": find_unused_parameters,
            "check_reduction": check_reduction,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
        }
        self.device = default_device()

    def control_precision(self) -> bool:
        return False

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: Any = None,
    ) -> Boosted:
        if not isinstance(model, TorchDDPModel):
            model = model.to(self.device)
            if self.device.type == "cuda":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model, None)
            model = TorchDDPModel(
                model,
                device_ids=[self.device] if self.device.type == "cuda" else None,
                **self.ddp_kwargs,
            )
        boosted: OptimizerWrapper | None = None
        if optimizer is not None:
            boosted = (
                optimizer
                if isinstance(optimizer, OptimizerWrapper)
                else OptimizerWrapper(optimizer)
            )
        return model, boosted, criterion, dataloader, lr_scheduler

    def support_no_sync(self) -> bool:
        return True

    @contextmanager
    def no_sync(  # type: ignore[override]  # a generator-based context manager
        self, model: nn.Module | None, optimizer: OptimizerWrapper | None = None
    ) -> Iterator[None]:
        if not isinstance(model, TorchDDPModel):
            raise TypeError(
                f"no_sync needs the model boosted by TorchDDPPlugin, got {type(model).__name__}"
            )
        ddp = model.module
        assert isinstance(ddp, DistributedDataParallel)
        with ddp.no_sync():
            yield
