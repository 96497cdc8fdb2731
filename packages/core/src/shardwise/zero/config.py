"""Frozen configuration objects of the ZeRO engine, validated once when built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise.chunk import ChunkDtypes
from shardwise.comm import ReduceScatterMethod

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_CHUNK_SIZE_NUMEL = 32 * 1024 * 1024
# Stages 1-2: elements per gradient bucket when `reduce_bucket_size` is not given: ColossalAI's
# LowLevelZeroPlugin default (`reduce_bucket_size_in_m=12`). Buckets several times larger left
# a 117M-parameter model four buckets to overlap with backward (zero2 / DDP 1.07 here against
# 0.94-1.04 at 8-12M elements, benchmarks/RESULTS.md), and each bucket in flight holds memory.
DEFAULT_REDUCE_BUCKET_NUMEL = 12 * 1024 * 1024


def default_device() -> torch.device:
    """`cuda:<current>` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compute_device(value: object, setting: str = "gemini_config['device']") -> torch.device:
    """The compute device named by `value` (a torch.device or its string), refused with the
    setting to change when this torch cannot compute there (e.g. "cuda" on a CPU-only build)."""
    if value is None:
        return default_device()
    if not isinstance(value, (torch.device, str)):
        raise TypeError(f"{setting} must be a torch.device or a string, got {value!r}")
    try:
        device = torch.device(value)
    except RuntimeError as error:
        raise ValueError(f"{setting} {value!r} is not a device: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{setting} is {str(device)!r} but CUDA is not available here "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False): set {setting} "
            f"to torch.device('cpu'), or leave it out to use cuda when there is one and the CPU "
            f"otherwise; the 'cuda' placement policy then keeps chunks on the CPU"
        )
    return device


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
    """Dtypes of the engine's tensors.

    Args:
        param_dtype: dtype parameters are stored and gathered in (the "16-bit copy" in mixed
            precision). The fp32 master weights are always kept separately when this is not fp32.
        compute_dtype: dtype forward and backward run in; defaults to `param_dtype`. Setting
            fp32 with a 16-bit `param_dtype` stores and communicates 16-bit but computes in fp32
            (useful on CPUs, where 16-bit matrix math is slow).
        reduce_dtype: dtype gradients are reduced in; defaults to `param_dtype`
            (`fp32_reduce_scatter=True` in the seeds' terms is `reduce_dtype=torch.float32`).
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

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


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How a model is sharded.

    Args:
        stage: 0 (replicated, gradients all-reduced), 1 (optimizer state sharded), 2 (also
            gradients sharded) or 3 (also parameters sharded).
        device: compute device; the chunks' payloads live there.
        mixed_precision: parameter, compute and reduction dtypes.
        chunk_size_numel: elements per chunk (stage 3) or gradient bucket (stages 0-2).
        process_group: the data-parallel group; None means the default group.
        overlap_communication: launch gradient reductions asynchronously during backward and
            wait for them at its end (stage 2), or before the next one starts (stage 3).
        prefetch: gather the next chunk in recorded execution order while the current one
            computes (stage 3).
        force_outputs_fp32: cast floating-point outputs of the model to fp32.
        reduce_scatter_bucket_bytes: reduce the gradients of consecutive chunks in one
            reduce-scatter until they reach this many bytes (0: one per chunk; stages 2-3).
        overlap_param_gather: stages 1 and 2: let the all-gather of updated parameters run
            into the next forward, each module waiting for its own chunks (see [Note: deferred
            parameter gathers] in zero/param_gather.py).
        gradient_reduction: "reduce_scatter", "all_to_all" (exchange slices, sum locally),
            "all_reduce" (keep this rank's slice), or "auto": all-to-all on gloo,
            reduce-scatter otherwise.
        param_init_fn: for a model built on the meta device, `fn(module)` initialises one
            module's own parameters and buffers once they have storage (see [Note: meta-device
            models] in zero/meta_init.py); None calls the module's `reset_parameters()`.
        shard_size: hybrid sharding: shard over groups of this many consecutive ranks and
            replicate across the groups (see [Note: hybrid sharding] in comm/topology.py);
            None shards over the whole process group.
        secondary_shard_size: stage 3, ZeRO++ hpZ: keep a secondary copy of each chunk's
            payload sharded over groups of this many consecutive ranks (the ranks of a node)
            from forward to backward, so that backward's all-gathers stay inside a group (see
            [Note: secondary shards] in chunk/chunk.py); None gathers over every rank.
        gather_units: stage 3: module classes or qualified module names to gather as one
            unit, besides the blocks that hold experts, which are found by themselves (see
            [Note: conditional units] in zero/gather_units.py).
    """

    stage: int
    device: torch.device
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    chunk_size_numel: int = DEFAULT_CHUNK_SIZE_NUMEL
    process_group: ProcessGroup | None = None
    overlap_communication: bool = False
    prefetch: bool = True
    force_outputs_fp32: bool = False
    reduce_scatter_bucket_bytes: int = 0
    gradient_reduction: str = "auto"
    overlap_param_gather: bool = False
    param_init_fn: Callable[[torch.nn.Module], None] | None = None
    gather_units: tuple[type[torch.nn.Module] | str, ...] = ()
    shard_size: int | None = None
    secondary_shard_size: int | None = None

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
        if isinstance(self.chunk_size_numel, bool) or not isinstance(self.chunk_size_numel, int):
            raise TypeError(
                f"chunk size must be an int number of elements, got {self.chunk_size_numel!r}"
            )
        if self.chunk_size_numel < 1:
            raise ValueError(f"chunk size must be at least 1 element, got {self.chunk_size_numel}")
        if (
            isinstance(self.reduce_scatter_bucket_bytes, bool)
            or not isinstance(self.reduce_scatter_bucket_bytes, int)
            or self.reduce_scatter_bucket_bytes < 0
        ):
            raise ValueError(
                f"reduce_scatter_bucket_bytes must be an int >= 0 (0: one reduction per chunk), "
                f"got {self.reduce_scatter_bucket_bytes!r}"
            )
        if self.gradient_reduction not in GRADIENT_REDUCTIONS:
            raise ValueError(
                f"gradient_reduction must be one of {GRADIENT_REDUCTIONS}, "
                f"got {self.gradient_reduction!r}"
            )
        if self.overlap_param_gather and self.stage == 3:
            raise ValueError(
                "overlap_param_gather applies to stages 1 and 2; stage 3 gathers each chunk "
                "before use and prefetches the next (prefetch=True)"
            )
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise TypeError(
                f"param_init_fn must be a callable taking a module, got {self.param_init_fn!r}"
            )
        if self.shard_size is not None and (
            isinstance(self.shard_size, bool)
            or not isinstance(self.shard_size, int)
            or self.shard_size < 1
        ):
            raise ValueError(f"shard_size must be a positive int of ranks, got {self.shard_size!r}")
        if self.shard_size is not None and self.stage == 0:
            raise ValueError("shard_size applies to stages 1-3; stage 0 shards nothing")
        self._check_secondary_shard_size()
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
        if not isinstance(self.mixed_precision, MixedPrecision):
            raise TypeError(
                f"mixed_precision must be a MixedPrecision, got {self.mixed_precision!r}"
            )

    def _check_secondary_shard_size(self) -> None:
        size = self.secondary_shard_size
        if size is None:
            return
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"secondary_shard_size must be a positive int of ranks, got {size!r}")
        if self.stage != 3:
            raise ValueError(
                f"secondary_shard_size (ZeRO++ hpZ) applies to stage 3, where backward gathers "
                f"parameters; got zero_stage={self.stage}"
            )
        if self.shard_size is not None:
            raise ValueError(
                "secondary_shard_size and shard_size cannot be combined: hybrid sharding keeps "
                "every all-gather inside its shard groups already; use shard_size for less "
                "inter-node traffic at full replication, or secondary_shard_size to keep "
                "sharding over every rank and gather backward's parameters inside the groups"
            )
