"""Shardformer's flags on GeminiPlugin: ColossalAI applies them only through its tensor-parallel
sharding (`ShardFormer(shard_config).optimize(model)` runs only when `tp_size > 1`), so at
`tp_size=1` they change nothing there either. A script that sets them (ColossalAI's llama
benchmark sets `enable_fused_normalization=get_accelerator().is_available()`) runs here; each
flag set is logged once per process."""

from __future__ import annotations

import logging

_log = logging.getLogger(__name__)
_logged: set[str] = set()


def accept_shardformer_flags(plugin: str, tp_size: int, **flags: bool) -> None:
    """Refuse tensor parallelism; accept Shardformer's kernel flags at `tp_size=1`, logging once
    per process each one set, as changing nothing.

    Args:
        plugin: the plugin named in messages.
        tp_size: the tensor-parallel size: 1 only.
        **flags: `enable_all_optimization`, `enable_fused_normalization`, ... by name.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{plugin}: tp_size must be a positive int, got {tp_size!r}")
    if tp_size > 1:
        raise ValueError(
            f"{plugin}(tp_size={tp_size}) cannot be honoured: shardwise is data parallelism "
            f"(ZeRO) without tensor parallelism; leave tp_size=1 and shard over every rank, or "
            f"replicate the sharded model with extra_dp_size"
        )
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{plugin}: {name} must be a bool, got {value!r}")
        if value and name not in _logged:
            _logged.add(name)
            _log.info(
                "%s(%s=True) changes nothing at tp_size=1: ColossalAI applies Shardformer's "
                "kernels only when it shards the model for tensor parallelism (tp_size > 1)",
                plugin,
                name,
            )
