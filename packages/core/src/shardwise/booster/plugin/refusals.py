"""Arguments of ColossalAI's plugins that data parallelism over one engine cannot honour, and
the precision names they take."""

from __future__ import annotations

import torch

from shardwise.engine.config import MixedPrecision, storage_precision

PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def refuse_model_parallel(plugin: str, **settings: object) -> None:
    """Refuse tensor parallelism, Shardformer's kernels and fp8 (set to anything but off)."""
    # A flag is off when False, a size when 1 (True == 1 in Python: flags are told apart).
    asked = {
        name: value
        for name, value in settings.items()
        if (value is True if isinstance(value, bool) else value not in (None, 1))
    }
    if asked:
        listed = ", ".join(f"{name}={value!r}" for name, value in asked.items())
        raise ValueError(
            f"{plugin}({listed}) cannot be honoured: shardwise is data parallelism (ZeRO) "
            f"only, without tensor parallelism, Shardformer's fused kernels or fp8; leave "
            f"them at their defaults (tp_size=1, the enable_* flags False, fp8 off)"
        )


def precision_of(plugin: str, precision: str, device: torch.device) -> MixedPrecision:
    """The engine's dtypes for a plugin's `precision`: storage and communication in it; compute
    in it on an accelerator and in fp32 on a CPU (16-bit matrix math is tens of times slower
    there)."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"{plugin}: precision must be one of {sorted(PRECISIONS)}, got {precision!r}"
        )
    return storage_precision(PRECISIONS[precision], device)


def shard_size_for(plugin: str, extra_dp_size: int, world_size: int) -> int | None:
    """`extra_dp_size` replicas of the sharded model: hybrid sharding over groups of
    world_size / extra_dp_size ranks (see [Note: hybrid sharding] in comm/topology.py)."""
    if isinstance(extra_dp_size, bool) or not isinstance(extra_dp_size, int) or extra_dp_size < 1:
        raise ValueError(f"{plugin}: extra_dp_size must be a positive int, got {extra_dp_size!r}")
    if extra_dp_size == 1:
        return None
    if world_size % extra_dp_size:
        raise ValueError(
            f"{plugin}: extra_dp_size={extra_dp_size} must divide the world size {world_size}"
        )
    return world_size // extra_dp_size
