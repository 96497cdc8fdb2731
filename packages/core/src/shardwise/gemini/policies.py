"""Placement policies as objects: where each chunk's payload and optimizer side start, and what
the policy lets the schedule do (prefetch, overlapped reduction).

See [Note: placement policies] in gemini/manager.py for what each policy places where.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import ClassVar

from shardwise.chunk import Chunk


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacementPolicy:
    """Base of the policies. Subclasses say where chunks start and what they allow."""

    name: ClassVar[str]
    allows_prefetch: ClassVar[bool] = True
    """Gathers may run ahead of the module that needs them (their memory is not planned)."""
    allows_overlapped_reduction: ClassVar[bool] = True
    """A gradient reduction may still run while backward goes on and the next gather starts."""
    needs_budget: ClassVar[bool] = False
    """The policy decides against a device budget, so one must be known."""

    @property
    def sharded_fraction(self) -> float:
        """The share of chunks, in chunk order, whose payload is sharded."""
        return 1.0

    def host_chunks(self, chunks: list[Chunk]) -> tuple[set[int], set[int]]:
        """Ids of the chunks whose payload shard, and of those whose optimizer side, start in
        host memory; every other buffer starts on the device."""
        return set(), set()


@dataclass(frozen=True, kw_only=True, slots=True)
class DevicePlacement(PlacementPolicy):
    """ "cuda" / "device": every buffer on the compute device."""

    name: ClassVar[str] = "cuda"


@dataclass(frozen=True, kw_only=True, slots=True)
class HostPlacement(PlacementPolicy):
    """ "cpu": sharded payloads and the whole optimizer side in host memory."""

    name: ClassVar[str] = "cpu"

    def host_chunks(self, chunks: list[Chunk]) -> tuple[set[int], set[int]]:
        return _sharded_and_trainable(chunks)


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticPlacement(PlacementPolicy):
    """ "static": fixed fractions of the chunks, in chunk order.

    Args:
        shard_param_frac: share of chunks sharded (the rest keep their payload gathered).
        offload_optim_frac: share of chunks whose optimizer side lives in host memory.
        offload_param_frac: share of chunks whose payload shard lives in host memory.
    """

    name: ClassVar[str] = "static"
    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0

    def __post_init__(self) -> None:
        for field_name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac"):
            _check_fraction(field_name, getattr(self, field_name))
        if self.offload_param_frac > 0 and self.shard_param_frac < 1:
            raise ValueError(
                f"offload_param_frac={self.offload_param_frac} needs every chunk sharded "
                f"(shard_param_frac=1.0, got {self.shard_param_frac}): a gathered chunk's "
                f"payload stays on the device"
            )

    @property
    def sharded_fraction(self) -> float:
        return float(self.shard_param_frac)

    def host_chunks(self, chunks: list[Chunk]) -> tuple[set[int], set[int]]:
        n = len(chunks)
        sharded = [c for c in chunks if not c.keep_gathered]
        trainable = [c for c in chunks if c.requires_grad]
        return (
            {id(c) for c in sharded[: math.floor(self.offload_param_frac * n)]},
            {id(c) for c in trainable[: math.floor(self.offload_optim_frac * n)]},
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoPlacement(PlacementPolicy):
    """ "auto": start as "cpu", then plan every gather against the device budget and move
    optimizer sides to the device where the warm-up showed room (see [Note: auto placement]).

    Args:
        activation_bytes: the step's activations on the device, as estimated before any step
            ran (`shardwise.planner.estimate_activation_bytes`), which the plan made at wrap
            keeps room for (see [Note: auto places from the wrap] in wrap_plan.py); None:
            a share of the budget.
        margin_ratio: the share, in [0, 1], of the device room left after warm-up that
            optimizer sides may use (the seeds' `gpu_margin_mem_ratio`: 0.0 keeps every
            optimizer side in host memory, as the seeds say); None, when it is not given: all
            of it, since a side on the device only saves traffic.
    """

    name: ClassVar[str] = "auto"
    # A prefetch and a reduction in flight are planned inside the budget (see [Note: auto
    # placement]): the prefetch when the warm-up left room for it, the reduction finished
    # early whenever room is short.
    allows_prefetch: ClassVar[bool] = True
    allows_overlapped_reduction: ClassVar[bool] = True
    needs_budget: ClassVar[bool] = True
    margin_ratio: float | None = None
    activation_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.margin_ratio is not None:
            _check_fraction("gpu_margin_mem_ratio", self.margin_ratio)
        value = self.activation_bytes
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ValueError(
                f"activation_memory_bytes must be an int >= 0 (bytes, e.g. "
                f"shardwise.planner.estimate_activation_bytes(...).total_bytes), got {value!r}"
            )

    def host_chunks(self, chunks: list[Chunk]) -> tuple[set[int], set[int]]:
        return _sharded_and_trainable(chunks)


PLACEMENT_POLICIES = ("cuda", "device", "cpu", "static", "auto")


def placement_policy(
    name: str,
    *,
    shard_param_frac: float = 1.0,
    offload_optim_frac: float = 0.0,
    offload_param_frac: float = 0.0,
    gpu_margin_mem_ratio: float | None = None,
    activation_memory_bytes: int | None = None,
) -> PlacementPolicy:
    """The policy object for the seeds' `placement_policy` name and its arguments, refusing
    arguments the named policy has no use for."""
    if not isinstance(name, str):
        raise TypeError(f"placement_policy must be a str, got {name!r}")
    if name not in PLACEMENT_POLICIES:
        raise ValueError(
            f"placement_policy must be one of {', '.join(map(repr, PLACEMENT_POLICIES))}, "
            f"got {name!r}"
        )
    fractions = {
        "shard_param_frac": shard_param_frac,
        "offload_optim_frac": offload_optim_frac,
        "offload_param_frac": offload_param_frac,
    }
    if name == "static":
        _check_fraction("shard_param_frac", shard_param_frac)
        _check_fraction("offload_param_frac", offload_param_frac)
        if offload_param_frac > 0 and (shard_param_frac != 1 or offload_optim_frac != 1):
            # ColossalAI's static policy warns and offloads no parameter unless every chunk is
            # sharded and every optimizer side is in host memory: a script written for it
            # places its chunks as it did there.
            warnings.warn(
                f"offload_param_frac={offload_param_frac} is ignored: parameters are offloaded "
                f"only when every chunk is sharded and every optimizer side is offloaded "
                f"(shard_param_frac=1.0 and offload_optim_frac=1.0, got {shard_param_frac} and "
                f"{offload_optim_frac}), as in ColossalAI",
                UserWarning,
                stacklevel=2,
            )
            fractions["offload_param_frac"] = 0.0
        return StaticPlacement(**fractions)
    StaticPlacement(**fractions)  # validates the values before saying they do not apply
    defaults = {"shard_param_frac": 1.0, "offload_optim_frac": 0.0, "offload_param_frac": 0.0}
    if fractions != defaults:
        changed = sorted(k for k in fractions if fractions[k] != defaults[k])
        raise ValueError(f"{changed} apply only to placement_policy='static', got {name!r}")
    if name == "auto":
        # Not given: the plan uses all the room (see [Note: auto placement]); a number is
        # honoured as the seeds define it, 0.0 keeping optimizer sides in host memory.
        return AutoPlacement(
            margin_ratio=gpu_margin_mem_ratio, activation_bytes=activation_memory_bytes
        )
    # Validates the values likewise.
    AutoPlacement(margin_ratio=gpu_margin_mem_ratio, activation_bytes=activation_memory_bytes)
    if gpu_margin_mem_ratio:
        raise ValueError(
            f"gpu_margin_mem_ratio applies only to placement_policy='auto', got {name!r}"
        )
    if activation_memory_bytes is not None:
        raise ValueError(
            f"activation_memory_bytes applies only to placement_policy='auto' (the plan it "
            f"makes at wrap), got {name!r}"
        )
    return HostPlacement() if name == "cpu" else DevicePlacement()


def replicated(policy: PlacementPolicy) -> StaticPlacement:
    """`policy` with every chunk's payload kept gathered on every rank, as ColossalAI's
    `strict_ddp_mode` documents ("no tensor sharding, each tensor is replicated"): parameters
    are never gathered or released, gradients are reduced each backward and the optimizer
    state stays sharded (the "static" policy at `shard_param_frac=0`, ColossalAI's ZeRO-2).
    The optimizer sides stay where `policy` put them ("cpu": in host memory); a payload
    offload does not apply to gathered payloads and is dropped. "auto", which plans where each
    shard lives, has nothing left to plan and is refused.

    Args:
        policy: the placement asked for beside the replication.
    """
    if isinstance(policy, AutoPlacement):
        raise ValueError(
            "strict_ddp_mode=True keeps every parameter replicated, so the 'auto' placement has "
            "no shard to place: use placement_policy='static' (optionally with "
            "offload_optim_frac) or 'cuda' with it"
        )
    if isinstance(policy, StaticPlacement):
        if policy.offload_param_frac > 0:
            warnings.warn(
                f"offload_param_frac={policy.offload_param_frac} is ignored: with "
                f"strict_ddp_mode=True every chunk keeps its payload gathered on the device",
                UserWarning,
                stacklevel=2,
            )
        return replace(policy, shard_param_frac=0.0, offload_param_frac=0.0)
    if isinstance(policy, HostPlacement):
        return StaticPlacement(shard_param_frac=0.0, offload_optim_frac=1.0)
    return StaticPlacement(shard_param_frac=0.0)


def _check_fraction(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def _sharded_and_trainable(chunks: list[Chunk]) -> tuple[set[int], set[int]]:
    return (
        {id(c) for c in chunks if not c.keep_gathered},
        {id(c) for c in chunks if c.requires_grad},
    )
