"""The planner: every stage and placement's memory per rank and traffic per step, whether it
fits, and the configuration to use.

[Note: which configuration is recommended]
The first that fits, in this order of preference: stage 0 (plain data parallelism: one
all-reduce, no re-gathering), stage 2 (the same bytes on the wire as stage 1, less memory, and
measured faster in this engine, see benchmarks/RESULTS.md), stage 1, then stage 3 with
placement "cuda" (3 psi on the wire, nothing through host memory), "auto" (host traffic only
for what does not fit), stage 2 with its optimizer side in host memory ("cpu", `cpu_offload`:
every gradient and parameter shard through host memory each step, the parameters whole on the
device), stage 3 "cpu" (every shard through host memory each step, the least device memory),
and last, where a disk tier is given (`disk_memory_bytes`), stages 2 and 3 "disk": "cpu" with
every fp32 master and optimizer state in the disk tier's files, read and written once a step.
Fitting means the device holds the model state, the gathered working set (two chunks with their
gradient buffer) and the given activation bytes within its memory, the host holds what is
offloaded (and, on the disk tier, the three chunks' optimizer sides its step holds at once)
within its memory, and the disk tier's files fit its bytes. The answer lists the configurations
by stage (DDP, stage 1, 2, 3; within a stage "cuda", "auto", "cpu", "disk"), not in this order,
and marks the one recommended.

[Note: wire buffers in the plan]
Quantized wire formats (`gather_format`, `reduce_format`: see [Note: wire formats] in
chunk/wire/formats.py) send fewer bytes, and hold buffers of their own beside the chunks they
move, counted in the working memory as the engine holds them:
- a quantized gather: this rank's record and every rank's, (N + 1) records of a shard, from
  its start until it is finished: one chunk's at stage 3 (the prefetch in flight while another
  computes), every chunk's at stages 1-2 (the step starts every gather and the next forward
  finishes them: see [Note: deferred parameter gathers] in runtime/param_gather.py);
- a quantized reduction: the (N - 1) records it sends and the (N - 1) it receives, and two
  fp32 slices (the sum and the decoded record added to it), for each reduction in flight:
  one at stage 3, two at stages 1-2 (see [Note: gradients in flight] in
  runtime/grad_reducer.py).
Their traffic is the records' bytes per element in place of the dtype's, and across groups a
quantized reduce-scatter of the records and an exact all-gather of the sums (see [Note:
quantized reductions]). Stage 0 (ColoDDP) takes no wire format, so a plan with one leaves it
out. With both formats "dtype" nothing here changes the plan.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from shardwise.chunk.search import DEFAULT_MIN_CHUNK_BYTES, default_chunk_search
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL, BlockQuantizer, check_wire_formats
from shardwise.planner.answer import Plan, PlanOption
from shardwise.planner.formulas import StateBytes, engine_bytes, zero_paper_bytes
from shardwise.planner.model_spec import ModelSpec

if TYPE_CHECKING:
    from torch import nn

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "hybridadam": 8, "sgd": 0, "sgd_momentum": 4}
# The order of preference (see [Note: which configuration is recommended]).
_PREFERENCE = [
    (0, "ddp"),
    (2, "cuda"),
    (1, "cuda"),
    (3, "cuda"),
    (3, "auto"),
    (2, "cpu"),
    (3, "cpu"),
    (2, "disk"),
    (3, "disk"),
]
# The order the answer lists them in: by stage, then by placement.
_PLACEMENTS = ("ddp", "cuda", "auto", "cpu", "disk")


def plan(
    model: nn.Module | ModelSpec,
    *,
    world_size: int,
    device_memory_bytes: int,
    host_memory_bytes: int,
    param_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    optimizer: str = "adam",
    chunk_size_numel: int | None = None,
    activation_bytes: int = 0,
    shard_size: int | None = None,
    secondary_shard_size: int | None = None,
    disk_memory_bytes: int = 0,
    gather_format: str = "dtype",
    reduce_format: str = "dtype",
    quant_block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL,
) -> Plan:
    """Memory per rank and traffic per step for stages 0-3 and the stage-3 placements, and the
    recommended configuration (see [Note: which configuration is recommended]).

    Args:
        model: a module (meta-device is fine) or a `ModelSpec`.
        world_size: data-parallel ranks.
        device_memory_bytes, host_memory_bytes: memory per rank.
        param_dtype, compute_dtype, reduce_dtype: as in `MixedPrecision`.
        optimizer: one of adam, adamw, hybridadam, sgd, sgd_momentum.
        chunk_size_numel: the chunk size to plan for; None searches as the wrappers do.
        activation_bytes: non-model bytes a step needs on the device.
        shard_size: hybrid sharding: stages 1-3 shard over groups of this many ranks and
            replicate across the groups; each rank's reduced gradient shard is all-reduced
            across groups once per step (see [Note: hybrid sharding] in comm/topology.py).
        secondary_shard_size: hpZ at stage 3: backward gathers inside groups of this many
            ranks, from secondary shards every rank holds from forward to backward (see
            [Note: secondary shards] in chunk/chunk.py); counted in the working memory.
        disk_memory_bytes: bytes the disk tier's files may take per rank (see [Note: the disk
            tier] in memory/disk_pool.py); 0 plans without a disk tier.
        gather_format, reduce_format, quant_block_numel: the wire formats, as in
            `gemini_config`; their buffers count in the working memory and their records in
            the traffic (see [Note: wire buffers in the plan]).
    """
    spec = model if isinstance(model, ModelSpec) else ModelSpec.from_module(model)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}"
        )
    if shard_size is not None and (
        isinstance(shard_size, bool)
        or not isinstance(shard_size, int)
        or shard_size < 1
        or world_size % shard_size
    ):
        raise ValueError(
            f"shard_size must be a positive int dividing world_size={world_size}, "
            f"got {shard_size!r}"
        )
    _check_secondary_shard_size(secondary_shard_size, world_size, shard_size)
    check_wire_formats(gather_format, reduce_format, quant_block_numel)
    gather_q = (
        None if gather_format == "dtype" else BlockQuantizer(gather_format, quant_block_numel)
    )
    reduce_q = (
        None if reduce_format == "dtype" else BlockQuantizer(reduce_format, quant_block_numel)
    )
    if (
        isinstance(disk_memory_bytes, bool)
        or not isinstance(disk_memory_bytes, int)
        or disk_memory_bytes < 0
    ):
        raise ValueError(
            f"disk_memory_bytes must be an int >= 0 (0: no disk tier), got {disk_memory_bytes!r}"
        )
    # The ranks one shard is spread over, and the replicas of each shard.
    shards = shard_size or world_size
    replicas = world_size // shards
    sizes = {
        "param": _bytes(param_dtype),
        "compute": _bytes(compute_dtype or param_dtype),
        "reduce": _bytes(reduce_dtype or param_dtype),
    }
    chunk, psi_padded, chunk_reason = _chunking(spec, shards, chunk_size_numel, sizes["param"])
    opt_bytes = OPTIMIZER_STATE_BYTES[optimizer]
    k_paper = opt_bytes + (0 if sizes["param"] == 4 else 4)
    options = []
    for stage, placement in _PREFERENCE:
        if placement == "disk" and not disk_memory_bytes:
            continue
        if stage == 0 and (gather_q or reduce_q):
            continue  # ColoDDP takes no wire format: see [Note: wire buffers in the plan]
        n = world_size if stage == 0 else shards
        state = engine_bytes(
            stage, psi_padded, n, param_bytes=sizes["param"],
            compute_bytes=sizes["compute"], reduce_bytes=sizes["reduce"],
            optimizer_bytes_per_param=opt_bytes,
        )  # fmt: skip
        working = 0.0
        if stage == 3:
            working = 2 * chunk * (sizes["param"] + sizes["compute"] + sizes["reduce"])
            if secondary_shard_size is not None:  # every chunk's slice, forward to backward
                working += psi_padded * sizes["param"] / secondary_shard_size
        if stage > 0:
            working += _wire_buffer_bytes(stage, chunk, psi_padded, n, gather_q, reduce_q)
        zero = StateBytes(params=0, grads=0, optimizer=0, master=0)
        disk = zero
        if stage == 3:
            device, host = (zero, state) if placement in ("cpu", "disk") else (state, zero)
        elif placement in ("cpu", "disk"):
            device, host = _offloaded_low_level(state, stage, psi_padded, n, sizes)
        else:
            device, host = state, zero
        if placement == "auto":
            device, host = _auto_split(state, device_memory_bytes, working + activation_bytes)
        host_working = 0.0
        if placement == "disk":
            # fp32 masters (held apart from the parameters on disk) and optimizer state go to
            # the files; the step holds three chunks' of them at once (see [Note: the disk
            # tier in the step] in engine/step_loop.py).
            shard_of_chunk = chunk / n
            disk = StateBytes(
                params=0, grads=0, optimizer=host.optimizer, master=4 * psi_padded / n
            )
            host = StateBytes(params=host.params, grads=host.grads, optimizer=0, master=0)
            host_working = 3 * shard_of_chunk * (4 + opt_bytes)
        wire = (n - 1) / n * spec.num_params
        # Bytes per element a gather and a reduce-scatter send: the dtype's, or the records'.
        gather_el = _sent_per_element(gather_q, chunk, n, sizes["param"])
        reduce_el = _sent_per_element(reduce_q, chunk, n, sizes["reduce"])
        # Stage 0 all-reduces gradients; 1 and 2 reduce-scatter them and all-gather parameters;
        # 3 gathers parameters twice (forward, backward).
        per_element = {
            0: 2 * sizes["reduce"],
            1: reduce_el + gather_el,
            2: reduce_el + gather_el,
            3: reduce_el + 2 * gather_el,
        }
        comm = per_element[stage] * wire
        in_node = 0.0
        if stage == 3 and secondary_shard_size is not None:
            # Backward's gathers run over the secondary groups instead of over all n ranks.
            s = secondary_shard_size
            in_node = gather_el * (s - 1) / s * spec.num_params
            comm += in_node - gather_el * wire
        # The reduced gradient shard, all-reduced across the groups (a ring: 2 (R - 1) / R);
        # quantized, a reduce-scatter of records and an all-gather of the exact sums.
        across = 0.0
        if stage > 0 and replicas > 1:
            if reduce_q is None:
                across = 2 * (replicas - 1) / replicas * sizes["reduce"] * psi_padded / n
            else:
                records = _sent_per_element(reduce_q, psi_padded // n, replicas, sizes["reduce"])
                across = (replicas - 1) / replicas * (records + sizes["reduce"]) * psi_padded / n
        comm += across
        offloaded = (host.total + disk.total) / max(state.total, 1)
        moved = offloaded * (2 * sizes["param"] + 4) * psi_padded / n if stage == 3 else 0.0
        if stage in (1, 2) and placement in ("cpu", "disk"):
            # Each reduced gradient shard to the host, the updated parameters back.
            moved = (sizes["reduce"] + sizes["param"]) * psi_padded / n
        device_fits = (
            # "auto" sizes its device part to the room left, so only what it cannot move must
            # fit (comparing the sum again can fail by a rounding of the split).
            working + activation_bytes <= device_memory_bytes
            if placement == "auto"
            else device.total + working + activation_bytes <= device_memory_bytes
        )
        fits = (
            device_fits
            and host.total + host_working <= host_memory_bytes
            and disk.total <= disk_memory_bytes
        )
        options.append(
            PlanOption(
                stage=stage, placement=placement, device=device, host=host, working_bytes=working,
                zero_paper_bytes=zero_paper_bytes(
                    stage, spec.num_params, n, param_bytes=sizes["param"],
                    grad_bytes=sizes["param"], k=k_paper,
                ),
                comm_bytes_per_step=comm, host_device_bytes_per_step=moved, fits=fits,
                cross_group_bytes_per_step=across, in_node_bytes_per_step=in_node,
                disk=disk, disk_bytes_per_step=2 * disk.total,
            )
        )  # fmt: skip
    recommended = next((option for option in options if option.fits), None)
    options.sort(key=lambda option: (option.stage, _PLACEMENTS.index(option.placement)))
    gathered = 2 * chunk * (sizes["param"] + sizes["compute"] + sizes["reduce"])
    gathered += _wire_buffer_bytes(3, chunk, psi_padded, shards, gather_q, reduce_q)
    return Plan(
        spec=spec,
        world_size=world_size,
        chunk_size_numel=chunk,
        psi_padded=psi_padded,
        options=options,
        recommended=recommended,
        device_memory_bytes=device_memory_bytes,
        activation_bytes=activation_bytes,
        smallest_budget_bytes=int(gathered + activation_bytes),
        shard_size=shard_size if replicas > 1 else None,
        secondary_shard_size=secondary_shard_size,
        chunk_size_reason=chunk_reason,
        gather_format=gather_format,
        reduce_format=reduce_format,
        quant_block_numel=quant_block_numel,
    )


def _sent_per_element(
    quantizer: BlockQuantizer | None, numel: int, ranks: int, dtype_bytes: int
) -> float:
    """Bytes per element of a collective over `ranks` of `numel` elements: the dtype's, or its
    shard's record over the shard (values padded to 4 bytes, and the scales)."""
    if quantizer is None:
        return float(dtype_bytes)
    shard = max(1, -(-numel // ranks))
    return quantizer.record_nbytes(shard) / shard


def _wire_buffer_bytes(
    stage: int,
    chunk: int,
    psi_padded: int,
    n: int,
    gather: BlockQuantizer | None,
    reduce: BlockQuantizer | None,
) -> int:
    """The quantized formats' own buffers a rank holds at once (see [Note: wire buffers in
    the plan])."""
    shard = -(-chunk // n)
    nbytes = 0
    if gather is not None:
        per_gather = (n + 1) * gather.record_nbytes(shard)
        # Stages 1-2: every chunk's, as many as psi_padded / chunk of them (rounded up).
        nbytes += per_gather if stage == 3 else -(-per_gather * psi_padded // chunk)
    if reduce is not None:
        in_flight = 1 if stage == 3 else 2
        nbytes += in_flight * (2 * (n - 1) * reduce.record_nbytes(shard) + 2 * 4 * shard)
    return nbytes


def _check_secondary_shard_size(size: int | None, world_size: int, shard_size: int | None) -> None:
    if size is None:
        return
    if (
        isinstance(size, bool)
        or not isinstance(size, int)
        or size < 1
        or world_size % size
        or size >= world_size
    ):
        raise ValueError(
            f"secondary_shard_size must be a positive int dividing world_size={world_size} and "
            f"smaller than it, got {size!r}"
        )
    if shard_size is not None:
        raise ValueError("secondary_shard_size and shard_size cannot be combined")


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _chunking(
    spec: ModelSpec, world_size: int, chunk_size_numel: int | None, param_bytes: int
) -> tuple[int, int, str]:
    """The chunk size (searched when not given, as the wrappers search it), the padded
    parameter count it implies, and what chose the size."""
    numels = list(spec.tensor_numels)
    if chunk_size_numel is None:
        if numels:
            # As the wrappers search it (the gathered bytes counted in the parameter dtype).
            result = default_chunk_search(
                [numels], world_size=world_size, param_element_size=param_bytes,
                gathered_element_size=param_bytes,
            )  # fmt: skip
            chunk_size_numel, reason = result.chunk_size_numel, result.reason
        else:
            chunk_size_numel = max(
                spec.largest_tensor_numel, DEFAULT_MIN_CHUNK_BYTES // param_bytes
            )
            reason = (
                f"chunk_size_numel {chunk_size_numel:,}: the minimum chunk size "
                f"({DEFAULT_MIN_CHUNK_BYTES // 2**20} MiB, ColossalAI's default; tensor sizes "
                f"unknown: plan a module, --model, for the searched size)"
            )
    else:
        reason = f"chunk_size_numel {chunk_size_numel:,} as given"
    if not numels:
        # Sizes unknown: at most N - 1 padding elements per chunk.
        chunks = math.ceil(spec.num_params / chunk_size_numel)
        return chunk_size_numel, spec.num_params + chunks * (world_size - 1), reason
    padded, used = 0, 0
    for numel in numels:
        if used and used + numel > max(chunk_size_numel, numel):
            padded += -(-used // world_size) * world_size
            used = 0
        used += numel
    padded += -(-used // world_size) * world_size
    return chunk_size_numel, padded, reason


def _offloaded_low_level(
    state: StateBytes, stage: int, psi_padded: int, n: int, sizes: dict[str, int]
) -> tuple[StateBytes, StateBytes]:
    """Stages 1-2 with `cpu_offload` (see [Note: offload at stages 1 and 2] in
    engine/packing.py): parameters (and stage 1's whole gradient) stay on the device; the fp32
    master (always apart from the parameters then), the fp32 gradient shard and the optimizer
    state move to the host."""
    shard = psi_padded / n
    device_grads = sizes["reduce"] * psi_padded if stage == 1 else 0.0
    device = StateBytes(params=state.params, grads=device_grads, optimizer=0, master=0)
    host = StateBytes(params=0, grads=4 * shard, optimizer=state.optimizer, master=4 * shard)
    return device, host


def _auto_split(
    state: StateBytes, device_memory: float, other_bytes: float
) -> tuple[StateBytes, StateBytes]:
    """The "auto" policy keeps on the device what fits beside the working set and activations,
    the rest in host memory."""
    room = max(0.0, device_memory - other_bytes)
    share = min(1.0, room / state.total) if state.total else 1.0
    scaled = {k: v * share for k, v in asdict(state).items()}
    rest = {k: v * (1 - share) for k, v in asdict(state).items()}
    return StateBytes(**scaled), StateBytes(**rest)
