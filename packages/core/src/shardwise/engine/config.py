"""Frozen configuration objects of the ZeRO engine, validated once when built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise.chunk import ChunkDtypes
from shardwise.chunk.search import (
    DEFAULT_MIN_CHUNK_BYTES,
    DEFAULT_SEARCH_N_GRIDS,
    DEFAULT_SEARCH_RANGE_BYTES,
)
from shardwise.comm import ReduceScatterMethod
from shardwise.comm.quantize import fp8_casts_work
from shardwise.engine.communication import Communication
from shardwise.engine.devices import compute_device, compute_dtype_on
from shardwise.gemini.policies import DevicePlacement, HostPlacement, PlacementPolicy
from shardwise.memory.buffer_pool import pool_supported

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_CHUNK_SIZE_NUMEL = 32 * 1024 * 1024
# Stages 1-2: elements per gradient bucket when `reduce_bucket_size` is not given: ColossalAI's
# LowLevelZeroPlugin default (`reduce_bucket_size_in_m=12`). Buckets several times larger left
# a 117M-parameter model four buckets to overlap with backward (zero2 / DDP 1.07 here against
# 0.94-1.04 at 8-12M elements, benchmarks/RESULTS.md), and each bucket in flight holds memory.
DEFAULT_REDUCE_BUCKET_NUMEL = 12 * 1024 * 1024


GRADIENT_REDUCTIONS = ("auto", *(method.value for method in ReduceScatterMethod))


def gradient_reduction_method(mode: str, group: ProcessGroup | None) -> ReduceScatterMethod:
    """Resolve `gradient_reduction`: "auto" exchanges slices with an all-to-all on gloo, whose
    reduce-scatter is slow (see [Note: reduce-scatter methods] in comm/collectives.py), and
    uses the backend's reduce-scatter elsewhere."""
    if mode not in GRADIENT_REDUCTIONS:
        raise ValueError(f"gradient_reduction must be one of {GRADIENT_REDUCTIONS}, got {mode!r}")
    if mode != "auto":
        return ReduceScatterMethod(mode)
    if dist.is_initialized() and dist.get_backend(group) == "gloo":
        return ReduceScatterMethod.ALL_TO_ALL
    return ReduceScatterMethod.NATIVE


def _check_dtype(name: str, value: object) -> None:
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(value).__name__} {value!r}")
    if value not in _FLOAT_DTYPES:
        raise ValueError(
            f"{name} must be one of torch.float32, torch.float16, torch.bfloat16, got {value}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedPrecision:
    """Dtypes of the engine's tensors."""

    param_dtype: torch.dtype = torch.float32
    """The dtype parameters are stored and gathered in (the "16-bit copy" in mixed
    precision). The fp32 master weights are always kept separately when this is not fp32."""
    compute_dtype: torch.dtype | None = None
    """The dtype forward and backward run in; None: `param_dtype`. fp32 with a 16-bit
    `param_dtype` stores and communicates 16-bit but computes in fp32 (useful on CPUs, where
    16-bit matrix math is slow)."""
    reduce_dtype: torch.dtype | None = None
    """The dtype gradients are reduced in; None: `param_dtype` (`fp32_reduce_scatter=True` in
    the seeds' terms is `reduce_dtype=torch.float32`)."""

    def __post_init__(self) -> None:
        _check_dtype("param_dtype", self.param_dtype)
        if self.compute_dtype is not None:
            _check_dtype("compute_dtype", self.compute_dtype)
        if self.reduce_dtype is not None:
            _check_dtype("reduce_dtype", self.reduce_dtype)

    def chunk_dtypes(self) -> ChunkDtypes:
        return ChunkDtypes(
            payload=self.param_dtype,
            compute=self.compute_dtype or self.param_dtype,
            reduce=self.reduce_dtype or self.param_dtype,
        )

    @property
    def uses_loss_scaling(self) -> bool:
        """fp16 gradients overflow without a dynamic loss scale; fp32 and bf16 do not need one."""
        dtypes = self.chunk_dtypes()
        return torch.float16 in (dtypes.payload, dtypes.compute, dtypes.reduce)


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


def storage_precision(
    dtype: torch.dtype,
    device: torch.device,
    *,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> MixedPrecision:
    """The engine's dtypes for a front door's precision of `dtype` (ColossalAI's `precision` /
    `mixed_precision`, Lightning's `Trainer(precision=...)`, TrainingArguments' fp16 / bf16):
    storage and communication in it; compute in it on an accelerator and in fp32 on a CPU
    (`devices.compute_dtype_on`) unless `compute_dtype` says otherwise.

    Args:
        dtype: torch.float16, torch.bfloat16 or torch.float32.
        device: the compute device.
        compute_dtype: the compute dtype asked for (None: the device's rule).
        reduce_dtype: the gradient-reduction dtype asked for (None: `dtype`).
    """
    _check_dtype("precision", dtype)
    return MixedPrecision(
        param_dtype=dtype,
        compute_dtype=compute_dtype or compute_dtype_on(device, dtype),
        reduce_dtype=reduce_dtype,
    )


def _int_at_least(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


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


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunking:
    """How parameters are packed into chunks (see [Note: chunk buffers] in chunk/chunk.py)."""

    size_numel: int | None = None
    """Elements per chunk, at stages 1-2 per gradient bucket. None: stage 3 searches a size
    (the fields below), stages 0-2 take `DEFAULT_REDUCE_BUCKET_NUMEL`."""
    search_range_bytes: int = DEFAULT_SEARCH_RANGE_BYTES
    """Stage 3's search: the range of chunk sizes tried above the smallest, in bytes."""
    search_n_grids: int = DEFAULT_SEARCH_N_GRIDS
    """Stage 3's search: how many sizes are tried in that range."""
    min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES
    """Stage 3's search: the smallest chunk, in bytes."""
    hidden_dim: int | None = None
    """Round chunk sizes up to a multiple of this (a layer's width), or None."""

    def __post_init__(self) -> None:
        if self.size_numel is not None and (
            isinstance(self.size_numel, bool) or not isinstance(self.size_numel, int)
        ):
            raise TypeError(
                f"chunk size must be an int number of elements, got {self.size_numel!r}"
            )
        if self.size_numel is not None and self.size_numel < 1:
            raise ValueError(f"chunk size must be at least 1 element, got {self.size_numel}")
        # Named as the seeds' gemini_config keys, which users set.
        for key, value in (
            ("chunk_search_range", self.search_range_bytes),
            ("min_chunk_size", self.min_chunk_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a number of bytes (int >= 0), got {value!r}")
        _int_at_least("chunk_search_n_grids", self.search_n_grids, 0)
        hidden = self.hidden_dim
        if hidden is not None and (
            isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1
        ):
            raise ValueError(f"hidden_dim must be a positive int, got {hidden!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where chunks live (see [Note: placement policies] in gemini/manager.py). At stages 1
    and 2, whose payloads stay gathered on the device, it is where the optimizer side lives:
    "cuda" (the device) or "cpu" (host memory: fp32 masters, reduced gradients and optimizer
    state, ColossalAI's `cpu_offload`; see [Note: offload at stages 1 and 2] in
    engine/packing.py)."""

    policy: PlacementPolicy = field(default_factory=DevicePlacement)
    """The placement policy, validated when built (`gemini.placement_policy(name, ...)`)."""
    device_budget_bytes: int | None = None
    """The most bytes of model state the compute device may hold; None: its capacity less 10%
    on CUDA, unlimited elsewhere ("auto" needs one there)."""
    pin_memory: bool = False
    """Pin host copies of chunks when the compute device is CUDA."""
    disk_fraction: float = 0.0
    """The disk tier (see [Note: the disk tier] in memory/disk_pool.py): the share, in [0, 1],
    of the chunks whose optimizer side the placement keeps in host memory that keep their
    fp32 master and optimizer state in files under `disk_dir` instead, the first in chunk
    order (HybridAdam's `nvme_offload_fraction`)."""
    disk_dir: str | None = None
    """Where the disk tier's files go (a folder per rank is made there and removed when the
    optimizer is closed or the process exits); None: the system's temporary directory."""
    host_budget_bytes: int | None = None
    """The most bytes of model state host memory may hold per rank: optimizer sides that the
    placement keeps in host memory beyond it go to the disk tier, the last in chunk order
    first (optimizer state counted as 8 bytes an element, Adam's, before it exists)."""
    host_buffer_pool: bool = False
    """Keep the chunk-sized buffers a step frees for the next ones instead of returning them
    to the allocator (see [Note: a pool of host buffers] in memory/buffer_pool.py): a shorter
    step for a higher peak, on a CPU device without a device budget."""

    def __post_init__(self) -> None:
        if not isinstance(self.policy, PlacementPolicy):
            raise TypeError(f"policy must be a PlacementPolicy, got {self.policy!r}")
        if self.device_budget_bytes is not None and (
            isinstance(self.device_budget_bytes, bool)
            or not isinstance(self.device_budget_bytes, int)
            or self.device_budget_bytes < 1
        ):
            raise ValueError(
                f"device_budget_bytes must be a positive int, got {self.device_budget_bytes!r}"
            )
        _check_bool("pin_memory", self.pin_memory)
        _check_bool("host_buffer_pool", self.host_buffer_pool)
        fraction = self.disk_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not (0 <= fraction <= 1)
        ):
            raise ValueError(
                f"nvme_offload_fraction (disk_fraction) must be a number in [0, 1], got "
                f"{fraction!r}"
            )
        if self.disk_dir is not None and not isinstance(self.disk_dir, str):
            raise TypeError(
                f"nvme_offload_dir (disk_dir) must be a str path, got {self.disk_dir!r}"
            )
        budget = self.host_budget_bytes
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 1
        ):
            raise ValueError(f"host_budget_bytes must be a positive int, got {budget!r}")

    @property
    def uses_disk(self) -> bool:
        """Whether any optimizer side may go to the disk tier."""
        return self.disk_fraction > 0 or self.host_budget_bytes is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class Reduction:
    """How gradients are reduced over ranks."""

    method: str = "auto"
    """ "reduce_scatter", "all_to_all" (exchange slices, sum locally), "all_reduce" (keep this
    rank's slice), or "auto": all-to-all on gloo, reduce-scatter otherwise. Where stage 1
    averages in backward for `.grad` (fp32, no hybrid sharding), every rank keeps the whole
    average: "auto" is an all-reduce there, and a reduce-scatter method named is followed by
    an all-gather of the summed slices."""
    bucket_bytes: int = 0
    """Stage 3: reduce consecutive chunks in one reduce-scatter until they reach this many
    bytes (0: one per chunk)."""
    predivide_factor: float = 1.0
    """Divide gradients by this before the reduction and by N / this after it."""

    def __post_init__(self) -> None:
        if self.method not in GRADIENT_REDUCTIONS:
            raise ValueError(
                f"gradient_reduction must be one of {GRADIENT_REDUCTIONS}, got {self.method!r}"
            )
        if (
            isinstance(self.bucket_bytes, bool)
            or not isinstance(self.bucket_bytes, int)
            or self.bucket_bytes < 0
        ):
            raise ValueError(
                f"reduce_scatter_bucket_bytes must be an int >= 0 (0: one reduction per chunk), "
                f"got {self.bucket_bytes!r}"
            )
        if (
            isinstance(self.predivide_factor, bool)
            or not isinstance(self.predivide_factor, (int, float))
            or not self.predivide_factor > 0
        ):
            raise ValueError(
                f"gradient_predivide_factor must be > 0, got {self.predivide_factor!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Overlap:
    """What runs in the background of compute."""

    communication: bool = True
    """Reduce gradients asynchronously while backward goes on (stages 2-3, and stage 1 where it
    averages in backward: see [Note: gradients in flight] in runtime/grad_reducer.py)."""
    param_gather: bool | None = None
    """Stages 1-2: let the all-gather of updated parameters run into the next forward, any read
    of a parameter before it waiting for its chunk (see [Note: deferred parameter gathers] in
    runtime/param_gather.py); False waits for it in the step. None: on at stages 1-2 where
    the device is a GPU (the all-gather runs on its own stream beside the forward), off on a
    CPU, where gloo's all-gather runs on the cores the forward computes on and overlapping it
    made the step slower, not faster (benchmarks/RESULTS.md, "Wire formats"); stage 3 has
    none to defer."""
    prefetch: bool = True
    """Stage 3: gather the next chunk of the recorded order while the current one computes."""
    prefetch_chunks: int = 1
    """Stage 3, with `prefetch`: how many chunks of the recorded order the prefetch gathers
    ahead of the module running (ColossalAI's `max_prefetch`); all of a module call's chunks
    count at once, so a prefetch may take more than this where one call needs several."""
    step_in_backward: bool = False
    """Stage 3: the optimizer steps each sharded chunk during backward, as soon as its reduced
    gradient is in, and `step()` only the rest: the same update, its host step overlapped
    with backward (see [Note: the optimizer steps during backward] in engine/backward_step.py;
    no clipping, no fp16 loss scaling, accumulation under `no_sync()`). The default of
    `zero_optim_wrapper`'s and `ZeroOptimizer`'s own argument."""

    def __post_init__(self) -> None:
        # Named as the seeds' options, which users set.
        _check_bool("overlap_communication", self.communication)
        _check_bool("step_in_backward", self.step_in_backward)
        if self.param_gather is not None:
            _check_bool("overlap_param_gather", self.param_gather)
        _check_bool("prefetch", self.prefetch)
        if (
            isinstance(self.prefetch_chunks, bool)
            or not isinstance(self.prefetch_chunks, int)
            or self.prefetch_chunks < 1
        ):
            raise ValueError(f"prefetch_chunks must be an int >= 1, got {self.prefetch_chunks!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """Which ranks shard and which replicate (see [Note: hybrid sharding] in
    comm/topology.py)."""

    process_group: ProcessGroup | None = None
    """The data-parallel group; None: the default group."""
    shard_size: int | None = None
    """Hybrid sharding: shard over groups of this many consecutive ranks and replicate across
    the groups; None shards over the whole group."""
    secondary_shard_size: int | None = None
    """Stage 3, ZeRO++ hpZ: keep a secondary copy of each chunk sharded over groups of this
    many consecutive ranks from forward to backward (see [Note: secondary shards] in
    chunk/chunk.py); None gathers over every rank."""

    def __post_init__(self) -> None:
        if self.shard_size is not None and (
            isinstance(self.shard_size, bool)
            or not isinstance(self.shard_size, int)
            or self.shard_size < 1
        ):
            raise ValueError(f"shard_size must be a positive int of ranks, got {self.shard_size!r}")
        size = self.secondary_shard_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"secondary_shard_size must be a positive int of ranks, got {size!r}")
        if size is not None and self.shard_size is not None:
            raise ValueError(
                "secondary_shard_size and shard_size cannot be combined: hybrid sharding keeps "
                "every all-gather inside its shard groups already; use shard_size for less "
                "inter-node traffic at full replication, or secondary_shard_size to keep "
                "sharding over every rank and gather backward's parameters inside the groups"
            )


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
