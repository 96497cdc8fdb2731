"""What a shardwise strategy asks of the engine: the user's `engine_config`, refined by the
strategy's own arguments, resolved on each rank's device and in the Trainer's precision (see
[Note: engine_config and the arguments that refine it] in shardwise/engine/refine.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardwise import Communication, EngineConfig, Topology
from shardwise.engine.communication import communication_settings
from shardwise.engine.refine import Parts, checked_engine_config, framework_config


@dataclass(frozen=True, slots=True)
class StrategySettings:
    """A strategy's engine settings before it knows its device and precision.

    Args:
        caller: the strategy's class name, named in errors.
        engine_config: the user's configuration (stage 3), or None.
        asked: the strategy's arguments translated (`shardwise.engine.refine.refine`).
        defaults: its default arguments translated, with "stage" 3.
    """

    caller: str
    engine_config: EngineConfig | None
    asked: Parts
    defaults: Parts

    def on(self, device: torch.device, dtype: torch.dtype, precision: str) -> EngineConfig:
        """The engine's configuration on `device`, storing parameters in `dtype` as
        `Trainer(precision=precision)` asks."""
        return framework_config(
            self.engine_config,
            device=device,
            dtype=dtype,
            asked=self.asked,
            defaults=self.defaults,
            caller=self.caller,
            precision_setting=f"Trainer(precision={precision!r})",
        )


def strategy_settings(
    caller: str,
    engine_config: object,
    asked: Parts,
    defaults: Parts,
    **shared: Any,
) -> StrategySettings:
    """A strategy's settings from `engine_config` and its arguments translated, with the
    arguments both strategies share (`shared`: shard_size, secondary_shard_size,
    gather_format, reduce_format, quant_block_numel) added. An engine_config is checked at
    once, on its own device and in its own dtype; the Trainer's device and precision are
    checked when the strategy is set up."""
    config = checked_engine_config(engine_config, caller)
    if config is not None and config.stage != 3:
        raise ValueError(
            f"{caller} runs ZeRO stage 3 (parameters, gradients and optimizer state sharded); "
            f"engine_config.stage is {config.stage}: build it with stage=3, or use "
            f"zero_model_wrapper / LowLevelZeroPlugin for stages 1 and 2"
        )
    settings = StrategySettings(
        caller=caller,
        engine_config=config,
        asked={
            **asked,
            # Hybrid sharding (see [Note: hybrid sharding] in shardwise/comm/topology.py) and
            # ZeRO++ hpZ (see [Note: secondary shards] in shardwise/chunk/chunk.py); the
            # engine checks the sizes against the world size when it wraps the module.
            "topology": Topology(
                shard_size=shared["shard_size"],
                secondary_shard_size=shared["secondary_shard_size"],
            ),
            # Wire formats (see [Note: wire formats] in shardwise/chunk/wire/formats.py); the
            # engine refuses fp8 where torch cannot cast to it on the device it wraps on.
            "communication": communication_settings(
                gather_format=shared["gather_format"],
                reduce_format=shared["reduce_format"],
                quant_block_numel=shared["quant_block_numel"],
                caller=caller,
            ),
        },
        defaults={
            **defaults,
            "stage": 3,
            "topology": Topology(),
            "communication": Communication(),
        },
    )
    if config is not None:
        settings.on(config.device, config.precision.param_dtype, "its dtype")
    return settings
