"""DPPluginBase (ColossalAI's `colossalai.booster.plugin.dp_plugin_base`): a plugin over the
default process group, with the distributed data loader every data-parallel plugin builds."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shardwise.booster import lora
from shardwise.booster.plugin.plugin_base import Plugin


class DPPluginBase(Plugin):
    """A data-parallel plugin over the default process group."""

    def __init__(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call shardwise.launch_from_torch() (or "
                "torch.distributed.init_process_group()) before building the plugin"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def support_lora(self) -> bool:
        return True

    def enable_lora(
        self,
        model: nn.Module,
        pretrained_dir: str | None = None,
        lora_config: Any = None,
        bnb_quantization_config: Any = None,
        quantize: bool = False,
    ) -> nn.Module:
        """peft's adapters added before `boost` (see `Booster.enable_lora` and [Note: LoRA on
        the engine] in booster/lora.py); each plugin saves them its own way."""
        return lora.enable_lora(
            type(self).__name__,
            model,
            pretrained_dir,
            lora_config,
            bnb_quantization_config,
            quantize,
        )

    def prepare_dataloader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        shuffle: bool = False,
        seed: int = 1024,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        distributed_sampler_cls: type[DistributedSampler[Any]] | None = None,
        **kwargs: Any,
    ) -> DataLoader[Any]:
        """A DataLoader giving this rank its share of `dataset` (a `DistributedSampler` over
        every rank, shuffled with `shuffle`); workers are seeded with `seed`, as ColossalAI's.
        Call `dataloader.sampler.set_epoch(epoch)` each epoch for a new shuffle."""
        sampler_cls = distributed_sampler_cls or DistributedSampler
        sampler = sampler_cls(
            dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle
        )

        def seed_worker(worker_id: int) -> None:
            np.random.seed(seed)
            torch.manual_seed(seed)
            random.seed(seed)

        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            worker_init_fn=seed_worker,
            drop_last=drop_last,
            pin_memory=pin_memory,
            num_workers=num_workers,
            **kwargs,
        )
