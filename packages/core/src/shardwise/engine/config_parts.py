"""The parts of the engine's configuration (`EngineConfig.precision`, `.chunking`,
`.placement`, `.reduction`, `.overlap`, `.topology`; the wire formats, `.communication`, are
engine/communication.py), each a frozen dataclass that checks its own values when built. How
the parts combine with each other and with the stage is `EngineConfig`'s check, in
engine/config.py, which re-exports the public names here."""

from __future__ import annotations

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
from shardwise.engine.devices import compute_dtype_on
from shardwise.gemini.policies import DevicePlacement, PlacementPolicy

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
