"""LowLevelZeroOptimizer (ColossalAI 0.5's constructor): ZeRO stage 1 or 2 from a torch optimizer
alone, the model left as the user built it.

[Note: ZeRO from the optimizer's parameters]
ColossalAI's low-level ZeRO wraps the optimizer, not the model: its parameters are flattened
into buckets in place and the user's model runs as it is. The engine packs parameters into
chunks through a module; here that module is a holder of the optimizer's parameters (in its
groups' order), which the engine wraps at stage 1 or 2. Packing keeps each parameter object
and points its storage into its chunk, so the user's model computes with the chunks' values
and its backward fills their gradients, without the model ever being wrapped. What needs the
model's own forward is not offered here: deferred parameter gathers (`overlap_allgather`;
each step waits for its gathers instead) and a compute dtype other than the parameters' own
(the model computes in its parameters' dtype, `forced_dtype` or the dtype they have).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwise.amp import loss_scale_from
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.engine.communication import communication_settings
from shardwise.engine.config import (
    Chunking,
    EngineConfig,
    MixedPrecision,
    Overlap,
    Placement,
    Topology,
)
from shardwise.engine.model import ZeroModel
from shardwise.engine.wrap import wrap_model, wrap_optimizer
from shardwise.gemini import placement_policy
from shardwise.zero.optimizer_wrapper import ZeroOptimizerWrapper


class _ParameterHolder(nn.Module):
    """The optimizer's parameters as one module's, for the engine to pack (see [Note: ZeRO
    from the optimizer's parameters]); its forward is never called."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        for index, param in enumerate(params):
            self.register_parameter(f"param_{index}", param)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("run the model itself: its parameters are the chunks' views")


class LowLevelZeroOptimizer(ZeroOptimizerWrapper):
    """ZeRO stage 1 (optimizer state sharded) or 2 (`partition_grad=True`: gradients too) over
    `optimizer`'s parameters; call `backward(loss)`, `step()` and `zero_grad()` on it while the
    model runs unwrapped (see [Note: ZeRO from the optimizer's parameters]).

    Args:
        optimizer: an elementwise torch optimizer over the model's parameters, not yet stepped.
        pg_to_param_list: refused unless None (one process group shards every parameter).
        initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale: the fp16 loss scale (ColossalAI's defaults).
        clip_grad_norm: clip the global gradient 2-norm to this in the step (0: none).
        verbose: accepted (skipped steps are reported by a warning when they keep coming).
        reduce_bucket_size: elements per gradient bucket (chunk).
        communication_dtype: the dtype gradients are reduced in (None: the parameters').
        overlap_communication: reduce each bucket in the background of backward.
        partition_grad: stage 2 when True, else stage 1.
        cpu_offload: fp32 masters, reduced gradients and optimizer state in host memory, the
            step on the host (see [Note: offload at stages 1 and 2] in engine/packing.py).
        dp_process_group: the group to shard over (None: the default group).
        extra_dp_group: refused unless None (LowLevelZeroPlugin's `extra_dp_size` replicates).
        forced_dtype: the dtype the parameters are cast to and computed in (None: theirs).
        master_weights: True only (fp32 masters are always kept).
        overlap_allgather: refused unless False (see the module note).
        fp8_communication: reduce gradients in fp8 with blockwise scales, and gather the
            updated parameters in fp8 after the step (see [Note: quantized gathers] and [Note:
            quantized reductions] in chunk/wire/formats.py), as ColossalAI's: the same as
            `gather_format="fp8"` and `reduce_format="fp8"`, with which it is not combined.
        backward_context: refused unless None.
        gather_format: beyond ColossalAI, by keyword: the parameter all-gathers after the
            step, "dtype" (the parameters' dtype, default), "int8" or "fp8" (one byte per
            value with an fp32 scale per block).
        reduce_format: beyond ColossalAI, by keyword: gradient reductions, "dtype"
            (`communication_dtype`, default), "int8" or "fp8" (an all-to-all of quantized
            slices summed in fp32 by their owner).
        quant_block_numel: beyond ColossalAI, by keyword: values per quantization block,
            each with one fp32 scale.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pg_to_param_list: dict[Any, list[nn.Parameter]] | None = None,
        initial_scale: int = 2**16,
        min_scale: int = 1,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 2,
        max_scale: int = 2**24,
        clip_grad_norm: float = 0.0,
        verbose: bool = False,
        reduce_bucket_size: int = 1024 * 1024,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = False,
        partition_grad: bool = False,
        cpu_offload: bool = False,
        dp_process_group: ProcessGroup | None = None,
        extra_dp_group: ProcessGroup | None = None,
        forced_dtype: torch.dtype | None = None,
        master_weights: bool = True,
        overlap_allgather: bool = False,
        fp8_communication: bool = False,
        backward_context: Any = None,
        *,
        gather_format: str = "dtype",
        reduce_format: str = "dtype",
        quant_block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        _refuse_unhonoured(
            pg_to_param_list=pg_to_param_list is not None,
            extra_dp_group=extra_dp_group is not None,
            master_weights=not master_weights,
            overlap_allgather=overlap_allgather,
            backward_context=backward_context is not None,
        )
        communication = communication_settings(
            gather_format=gather_format,
            reduce_format=reduce_format,
            quant_block_numel=quant_block_numel,
            fp8_communication=fp8_communication,
            caller=type(self).__name__,
        )
        if not isinstance(partition_grad, bool):
            raise TypeError(f"partition_grad must be a bool, got {partition_grad!r}")
        params = list(dict.fromkeys(p for group in optimizer.param_groups for p in group["params"]))
        if not params:
            raise ValueError("the optimizer holds no parameters")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(
                f"the parameters must live on one device, got {sorted(map(str, devices))}"
            )
        dtype = forced_dtype or params[0].dtype
        config = EngineConfig(
            stage=2 if partition_grad else 1,
            device=devices.pop(),
            precision=MixedPrecision(
                param_dtype=dtype, compute_dtype=dtype, reduce_dtype=communication_dtype
            ),
            chunking=Chunking(size_numel=reduce_bucket_size),
            placement=Placement(policy=placement_policy("cpu" if cpu_offload else "cuda")),
            overlap=Overlap(communication=overlap_communication, param_gather=False),
            topology=Topology(process_group=dp_process_group),
            communication=communication,
        )
        self.model: ZeroModel = wrap_model(_ParameterHolder(params), config)
        engine = wrap_optimizer(
            self.model,
            optimizer,
            loss_scale=loss_scale_from(LowLevelZeroOptimizer.__init__, locals()),
            max_norm=clip_grad_norm,
        )
        super().__init__(engine)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, unreduced, in the backward passes inside."""
        with self.model.no_sync():
            yield


def _refuse_unhonoured(**asked: bool) -> None:
    named = sorted(name for name, given in asked.items() if given)
    if named:
        raise ValueError(
            f"LowLevelZeroOptimizer cannot honour {named}: one process group shards every "
            f"parameter, fp32 master weights are kept on the compute device and parameters "
            f"are gathered in the step; for "
            f"replicas LowLevelZeroPlugin(extra_dp_size=...), for overlapped gathers "
            f"LowLevelZeroPlugin(overlap_allgather=True)"
        )
