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

from shardwise.booster import lora
from shardwise.booster.plugin.dp_plugin_base import DPPluginBase
from shardwise.booster.plugin.plugin_base import Boosted
from shardwise.booster.plugin.refusals import refuse_model_parallel
from shardwise.checkpoint_io import GeneralCheckpointIO
from shardwise.comm import CommStats
from shardwise.engine.devices import default_device
from shardwise.interface import ModelWrapper, OptimizerWrapper
from shardwise.lazy import LazyInitContext


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
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            lora.add_adapters_to_optimizer(model, optimizer)  # see [Note: LoRA on the engine]
        if not isinstance(model, TorchDDPModel):
            # DDP broadcasts rank 0's values at once: a lazily built model gets them first.
            LazyInitContext.materialize(model)
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

    def get_checkpoint_io(self) -> GeneralCheckpointIO:
        return GeneralCheckpointIO()

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

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str, use_safetensors: bool = False
    ) -> None:
        """Rank 0 writes the adapters (every rank holds them whole under DDP)."""
        name = type(self).__name__
        if not isinstance(model, TorchDDPModel):
            raise TypeError(
                f"{name}: save_lora_as_pretrained needs the boosted model, got "
                f"{type(model).__name__}"
            )
        peft_model = lora.peft_model_of(model, name)
        values = {
            key: tensor.detach().to("cpu", copy=True)
            for key, tensor in lora.saved_tensors(peft_model).items()
        }
        lora.save_adapters(peft_model, checkpoint, values, use_safetensors, CommStats())
