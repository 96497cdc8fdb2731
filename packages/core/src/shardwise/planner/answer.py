"""The planner's answer: each configuration's memory per rank and traffic per step
(`PlanOption`), and the plan that lists them and names the one to use (`Plan`), as a table or
JSON. `plan()` in plan.py computes it (see [Note: which configuration is recommended] there).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.planner.formulas import StateBytes
from shardwise.planner.model_spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class PlanOption:
    """One stage and placement, for one rank."""

    stage: int
    placement: str
    device: StateBytes
    host: StateBytes
    working_bytes: float
    zero_paper_bytes: float
    comm_bytes_per_step: float
    host_device_bytes_per_step: float
    fits: bool
    cross_group_bytes_per_step: float = 0.0
    """Hybrid sharding: of `comm_bytes_per_step`, what crosses shard groups."""
    in_node_bytes_per_step: float = 0.0
    """hpZ (stage 3): of `comm_bytes_per_step`, backward's gathers inside the secondary groups."""
    disk: StateBytes = field(
        default_factory=lambda: StateBytes(params=0, grads=0, optimizer=0, master=0)
    )
    """What the disk tier's files hold (fp32 masters and optimizer state)."""
    disk_bytes_per_step: float = 0.0
    """Bytes read from and written to the disk tier per step."""

    @property
    def name(self) -> str:
        return "DDP" if self.stage == 0 else f"stage {self.stage} ({self.placement})"

    def device_needed_bytes(self, activation_bytes: int) -> float:
        """What the device must hold for this configuration: its model state, the working set
        and `activation_bytes` of activations (the figure its `fits` compares with the device
        memory)."""
        return self.device.total + self.working_bytes + activation_bytes


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The planner's answer."""

    spec: ModelSpec
    world_size: int
    chunk_size_numel: int
    psi_padded: int
    options: list[PlanOption] = field(default_factory=list)
    recommended: PlanOption | None = None
    device_memory_bytes: int = 0
    activation_bytes: int = 0
    """The activations a step needs on the device, as given (counted in every device figure;
    0: not counted, so those figures are lower bounds)."""
    smallest_budget_bytes: int = 0
    """The least device memory stage 3 trains in with "auto" or "cpu" placement: the chunks
    gathered at once (in the parameter, compute and reduce dtypes) plus the activations. "auto"
    trains wherever "cpu" does, so one figure serves both."""
    shard_size: int | None = None
    """Hybrid sharding's group size (None: sharded over all ranks)."""
    secondary_shard_size: int | None = None
    """hpZ's group size for backward's gathers at stage 3 (None: without hpZ)."""
    chunk_size_reason: str = ""
    """What chose `chunk_size_numel`: the search's reason, as the wrappers log it."""
    gather_format: str = "dtype"
    """The parameter gathers' wire format (see [Note: wire buffers in the plan])."""
    reduce_format: str = "dtype"
    """The gradient reductions' wire format."""
    quant_block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL
    """Values per quantization block."""

    @property
    def zero_stage(self) -> int | None:
        return None if self.recommended is None else self.recommended.stage

    @property
    def gemini_config(self) -> dict[str, Any]:
        """Keyword options for `zero_model_wrapper(model, plan.zero_stage, plan.gemini_config)`."""
        hybrid = {"shard_size": self.shard_size} if self.shard_size is not None else {}
        if self.recommended is None or self.recommended.stage == 0:
            return {}
        disk = {"nvme_offload_fraction": 1.0} if self.recommended.placement == "disk" else {}
        wire: dict[str, Any] = {}
        if self.gather_format != "dtype":
            wire["gather_format"] = self.gather_format
        if self.reduce_format != "dtype":
            wire["reduce_format"] = self.reduce_format
        if wire and self.quant_block_numel != DEFAULT_QUANT_BLOCK_NUMEL:
            wire["quant_block_numel"] = self.quant_block_numel
        if self.recommended.stage != 3:
            return {**hybrid, **disk, **wire}
        config: dict[str, Any] = {
            "placement_policy": "cpu" if disk else self.recommended.placement,
            **disk,
            "chunk_size_numel": self.chunk_size_numel,
            **hybrid,
            **wire,
        }
        if self.secondary_shard_size is not None:
            config["secondary_shard_size"] = self.secondary_shard_size
        if self.recommended.placement == "auto":
            config["device_budget_bytes"] = self.device_memory_bytes
        return config

    @property
    def optim_config(self) -> dict[str, Any]:
        """Options for `zero_optim_wrapper(..., optim_config=plan.optim_config)`."""
        if self.recommended is None or self.recommended.stage not in (1, 2):
            return {}
        offload = {"cpu_offload": True} if self.recommended.placement in ("cpu", "disk") else {}
        return {"reduce_bucket_size": self.chunk_size_numel, **offload}

    def wrapper_call(self) -> str:
        if self.recommended is None:
            return "# nothing fits: add ranks, device memory or host memory"
        if self.recommended.stage == 0:
            return "model = ColoDDP(model)"
        return (
            f"model = zero_model_wrapper(model, zero_stage={self.recommended.stage}, "
            f"gemini_config={self.gemini_config!r})\n"
            f"optimizer = zero_optim_wrapper(model, optimizer, optim_config={self.optim_config!r})"
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "world_size": self.world_size,
                "shard_size": self.shard_size,
                "secondary_shard_size": self.secondary_shard_size,
                "num_params": self.spec.num_params,
                "psi_padded": self.psi_padded,
                "chunk_size_numel": self.chunk_size_numel,
                "chunk_size_reason": self.chunk_size_reason,
                "activation_bytes": self.activation_bytes,
                "options": [
                    {**asdict(option), "name": option.name, "device_total": option.device.total,
                     "device_needed_bytes": option.device_needed_bytes(self.activation_bytes),
                     "host_total": option.host.total, "disk_total": option.disk.total}
                    for option in self.options
                ],
                "recommended": None if self.recommended is None else self.recommended.name,
                "smallest_budget_bytes": {"auto": self.smallest_budget_bytes,
                                          "cpu": self.smallest_budget_bytes},
                "zero_stage": self.zero_stage,
                "gemini_config": self.gemini_config,
                "optim_config": self.optim_config,
            },
            indent=1,
        )  # fmt: skip

    def table(self) -> str:
        """The configurations by stage, one row each (the recommended one's `fits` says so),
        then what the device figures count, the chunk size, the smallest budget and the
        wrapper call."""
        hybrid = self.shard_size is not None
        hpz = self.secondary_shard_size is not None
        disk = any(option.placement == "disk" for option in self.options)
        rows = [
            "| configuration | device GB | host GB "
            + ("| disk GB " if disk else "")
            + "| ZeRO paper GB | sent GB/step "
            + ("| across groups GB/step " if hybrid else "")
            + ("| of which in node (hpZ) GB/step " if hpz else "")
            + "| host<->device GB/step "
            + ("| disk GB/step " if disk else "")
            + "| fits |",
            "| --- | ---: | ---: | "
            + ("---: | " if disk else "")
            + "---: | ---: | "
            + ("---: | " if hybrid else "")
            + ("---: | " if hpz else "")
            + ("---: | " if disk else "")
            + "---: | :---: |",
        ]
        for option in self.options:
            across = f"{_gb(option.cross_group_bytes_per_step)} | " if hybrid else ""
            across += f"{_gb(option.in_node_bytes_per_step)} | " if hpz else ""
            on_disk = f"{_gb(option.disk.total)} | " if disk else ""
            disk_traffic = f"{_gb(option.disk_bytes_per_step)} | " if disk else ""
            fits = "no" if not option.fits else "yes"
            fits += ", recommended" if option is self.recommended else ""
            rows.append(
                f"| {option.name} | {_gb(option.device_needed_bytes(self.activation_bytes))} | "
                f"{_gb(option.host.total)} | {on_disk}{_gb(option.zero_paper_bytes)} | "
                f"{_gb(option.comm_bytes_per_step)} | {across}"
                f"{_gb(option.host_device_bytes_per_step)} | {disk_traffic}"
                f"{fits} |"
            )
        chosen = "none fits" if self.recommended is None else self.recommended.name
        smallest = (
            f"smallest device budget for stage 3 with 'auto' or 'cpu' placement: "
            f"{_gb(self.smallest_budget_bytes)} GB (the chunks gathered at once and the "
            f"activations; 'auto' trains wherever 'cpu' does)"
        )
        counted = (
            f"{_gb(self.activation_bytes)} GB of activations (activation_bytes: "
            f"--activation-memory, or estimated from --model at --batch x --seq-len)"
            if self.activation_bytes
            else "no activations (none given, so each is a lower bound: pass activation_bytes, "
            "--activation-memory, or --batch and --seq-len with --model to estimate them)"
        )
        device = f"device GB: the model state, the chunks gathered at once and {counted}"
        chunks = f"stage-3 chunk size: {self.chunk_size_reason}"
        lines = [*rows, "", device, chunks, smallest, f"recommended: {chosen}"]
        lines.append(self.wrapper_call())
        return "\n".join(lines)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f}" if nbytes >= 1e8 else f"{nbytes / 1e9:.3g}"
