"""The engine's configuration, `EngineConfig`: the stage, the device and the parts, checked
once when built. Each part checks its own values (engine/config_parts.py,
engine/communication.py); the checks here are those that look at the stage, the device or
several parts together. The parts and their public helpers are re-exported here, where
callers import them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shardwise.comm.quantize import fp8_casts_work
from shardwise.engine.communication import Communication
from shardwise.engine.config_parts import (
    DEFAULT_CHUNK_SIZE_NUMEL,
    DEFAULT_REDUCE_BUCKET_NUMEL,
    GRADIENT_REDUCTIONS,
    Chunking,
    MixedPrecision,
    Overlap,
    Placement,
    Reduction,
    Topology,
    _check_bool,
    gradient_reduction_method,
    storage_precision,
)
from shardwise.engine.devices import compute_device
from shardwise.gemini.policies import DevicePlacement, HostPlacement
from shardwise.memory.buffer_pool import pool_supported

__all__ = [
    "DEFAULT_CHUNK_SIZE_NUMEL",
    "DEFAULT_REDUCE_BUCKET_NUMEL",
    "GRADIENT_REDUCTIONS",
    "Chunking",
    "Communication",
    "EngineConfig",
    "MixedPrecision",
    "Overlap",
    "Placement",
    "Reduction",
    "Topology",
    "gradient_reduction_method",
    "storage_precision",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """How a model is sharded: the one configuration every front door translates into, parsed
    and validated once (zero/front_door.py), from which the model is built (engine/build.py)."""

    stage: int
    """0 (replicated), 1 (optimizer state sharded), 2 (gradients too), 3 (parameters too)."""
    device: torch.device
    """The compute device; chunks' payloads and gathered buffers live there."""
    precision: MixedPrecision = field(default_factory=MixedPrecision)
    """Parameter (storage and communication), compute and reduction dtypes."""
    chunking: Chunking = field(default_factory=Chunking)
    """How parameters are packed into chunks (stages 1-2: gradient buckets)."""
    placement: Placement = field(default_factory=Placement)
    """Stage 3: where chunks live, device or host memory, under which budget."""
    reduction: Reduction = field(default_factory=Reduction)
    """How gradients are reduced over ranks."""
    overlap: Overlap = field(default_factory=Overlap)
    """What communication runs in the background of compute."""
    topology: Topology = field(default_factory=Topology)
    """Which ranks shard and which replicate."""
    communication: Communication = field(default_factory=Communication)
    """What parameters are gathered in and gradients reduced in (quantized or not)."""
    gather_units: tuple[type[torch.nn.Module] | str, ...] = ()
    """Stage 3: module classes or qualified names to gather as one conditional unit, besides
    the blocks that hold experts (see [Note: conditional units] in runtime/gather_units.py)."""
    force_outputs_fp32: bool = False
    """Cast the model's floating-point outputs to fp32."""
    param_init_fn: Callable[[torch.nn.Module], None] | None = None
    """A model built on the meta device: `fn(module)` initialises one module's own tensors
    (see [Note: meta-device models] in prepare/meta_init.py); None calls `reset_parameters()`."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or not isinstance(self.stage, int):
            raise TypeError(
                f"zero_stage must be an int 0-3, got {type(self.stage).__name__} {self.stage!r}"
            )
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.stage}")
        if not isinstance(self.device, torch.device):
            raise TypeError(f"device must be a torch.device, got {self.device!r}")
        compute_device(self.device, "device")
        parts = (
            ("precision", MixedPrecision),
            ("chunking", Chunking),
            ("placement", Placement),
            ("reduction", Reduction),
            ("overlap", Overlap),
            ("topology", Topology),
            ("communication", Communication),
        )
        for name, kind in parts:
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        _check_bool("force_outputs_fp32", self.force_outputs_fp32)
        if self.overlap.param_gather is True and self.stage == 3:
            raise ValueError(
                "overlap_param_gather applies to stages 1 and 2; stage 3 gathers each chunk "
                "before use and prefetches the next (prefetch=True)"
            )
        if self.overlap.step_in_backward and self.stage != 3:
            raise ValueError(
                f"step_in_backward applies to stage 3, whose sharded chunks can step during "
                f"backward; got zero_stage={self.stage}"
            )
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise TypeError(
                f"param_init_fn must be a callable taking a module, got {self.param_init_fn!r}"
            )
        if self.topology.shard_size is not None and self.stage == 0:
            raise ValueError("shard_size applies to stages 1-3; stage 0 shards nothing")
        if self.topology.secondary_shard_size is not None and self.stage != 3:
            raise ValueError(
                f"secondary_shard_size (ZeRO++ hpZ) applies to stage 3, where backward gathers "
                f"parameters; got zero_stage={self.stage}"
            )
        if not isinstance(self.gather_units, tuple):
            raise TypeError(
                f"gather_units must be a tuple of module classes or qualified module names, "
                f"got {self.gather_units!r}"
            )
        if self.gather_units and self.stage != 3:
            raise ValueError(
                f"gather_units applies to stage 3 (where parameters are gathered), "
                f"got zero_stage={self.stage}"
            )
        if self.stage < 3:
            _check_low_level_placement(self.stage, self.placement)
        _check_communication(self)
        _check_buffer_pool(self)

    @property
    def pools_host_buffers(self) -> bool:
        """Whether chunk buffers are kept for reuse (see [Note: a pool of host buffers] in
        memory/buffer_pool.py), as asked (checked where it cannot apply)."""
        return self.placement.host_buffer_pool

    @property
    def offloads_optimizer(self) -> bool:
        """Stages 1-2: the optimizer side lives in host memory (see `Placement`)."""
        return self.stage < 3 and isinstance(self.placement.policy, HostPlacement)

    @property
    def defers_param_gather(self) -> bool:
        """Whether the step leaves its parameter all-gathers running (see `Overlap`)."""
        if self.overlap.param_gather is None:
            return self.stage in (1, 2) and self.device.type == "cuda"
        return self.overlap.param_gather

    @property
    def chunk_size_numel(self) -> int:
        """Elements per chunk once known (stage 3 searches it before building: see
        engine/build.py)."""
        if self.chunking.size_numel is not None:
            return self.chunking.size_numel
        if self.stage < 3:
            return DEFAULT_REDUCE_BUCKET_NUMEL
        raise ValueError("stage 3's chunk size is searched when the model is built")


def _check_low_level_placement(stage: int, placement: Placement) -> None:
    """Stages 0-2 keep every payload gathered on the device: only the optimizer side can move,
    all of it or none (`cpu_offload`); stage 0 has no optimizer side."""
    policy = placement.policy
    allowed = (DevicePlacement,) if stage == 0 else (DevicePlacement, HostPlacement)
    if not isinstance(policy, allowed):
        raise ValueError(
            f"placement_policy={policy.name!r} applies to stage 3, which shards parameters; "
            f"at stage {stage} parameters stay gathered on the device"
            + (
                ", and the optimizer side lives there ('cuda') or in host memory ('cpu', "
                "ColossalAI's cpu_offload=True)"
                if stage
                else " (stage 0 keeps no optimizer side: step your own optimizer)"
            )
        )
    if placement.device_budget_bytes is not None:
        raise ValueError(
            f"device_budget_bytes applies to stage 3 placement, got zero_stage={stage}; "
            f"at stages 1 and 2 use placement_policy='cpu' (cpu_offload) to keep the optimizer "
            f"side off the device"
        )


def _check_communication(config: EngineConfig) -> None:
    """Refuse wire formats the configuration cannot honour, naming the fix."""
    wire = config.communication
    if not wire.quantizes:
        return
    if config.stage == 0:
        raise ValueError(
            f"gather_format={wire.gather!r} / reduce_format={wire.reduce!r} apply to stages "
            f"1-3; stage 0 (ColoDDP) gathers nothing and averages gradients as DDP does, in "
            f"the parameters' dtype"
        )
    if "fp8" in (wire.gather, wire.reduce) and not fp8_casts_work(config.device):
        raise ValueError(
            f"the fp8 wire format (gather_format / reduce_format 'fp8', fp8_communication) "
            f"needs torch.float8_e4m3fn casts on {config.device}, which torch "
            f"{torch.__version__} does not do there; use 'int8' instead"
        )
    if wire.reduce != "dtype" and config.reduction.method not in ("auto", "all_to_all"):
        raise ValueError(
            f"reduce_format={wire.reduce!r} exchanges quantized slices with an all-to-all, "
            f"each summed by its owner; gradient_reduction="
            f"{config.reduction.method!r} cannot run with it: leave it 'auto' or set "
            f"'all_to_all', or set reduce_format='dtype'"
        )


def _keeps_to_a_budget(placement: Placement) -> bool:
    return placement.policy.needs_budget or placement.device_budget_bytes is not None


def _check_buffer_pool(config: EngineConfig) -> None:
    if not config.placement.host_buffer_pool:
        return
    if config.device.type != "cpu":
        raise ValueError(
            f"host_buffer_pool=True keeps host buffers for a CPU device; the device is "
            f"{config.device}, whose allocator already reuses its memory: leave it unset"
        )
    if not pool_supported():
        raise ValueError(
            f"host_buffer_pool=True needs a torch that moves memory between storages "
            f"(UntypedStorage._swap_data_ptr_, torch 2.13); this is torch {torch.__version__}. "
            f"Leave it unset"
        )
    if _keeps_to_a_budget(config.placement):
        raise ValueError(
            "host_buffer_pool=True with a device budget (placement_policy='auto' or "
            "device_budget_bytes): spare buffers would take from the budget the placement "
            "keeps to. Leave it unset, or drop the budget"
        )
