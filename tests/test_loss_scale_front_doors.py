"""The seven loss-scale keywords (ColossalAI's `initial_scale`, `min_scale`, `growth_factor`,
`backoff_factor`, `growth_interval`, `hysteresis`, `max_scale`) reach the scaler the optimizer
steps with from every front door, through their one translation
(`shardwise.amp.loss_scale_from`); a `loss_scale=LossScaleConfig(...)` passes them as one
object, which a keyword given otherwise than its default refines (the Booster's GeminiPlugin
hands its `GeminiOptimizer` the object it built). Two ranks, fp16 storage (where the dynamic
scale applies), every front door built once in the same group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import pytest
import torch
from torch import nn

from shardwise import GeminiDDP, HybridAdam, zero_model_wrapper, zero_optim_wrapper
from shardwise.amp import DynamicGradScaler, LossScaleConfig, loss_scale_from
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
from shardwise.testing import run_ranks
from shardwise.zero import (
    GeminiAdamOptimizer,
    GeminiOptimizer,
    LowLevelZeroOptimizer,
    ShardedModelV2,
    ShardedOptimizerV2,
    TensorShardStrategy,
)
from shardwise_hf import ShardwiseCallback
from shardwise_lightning import FullyShardedStrategy, GeminiStrategy

# Every setting off its default at every front door.
SEVEN: dict[str, Any] = {
    "initial_scale": 2.0**10,
    "min_scale": 2.0,
    "growth_factor": 3.0,
    "backoff_factor": 0.25,
    "growth_interval": 7,
    "hysteresis": 3,
    "max_scale": 2.0**20,
}
GIVEN = LossScaleConfig(**SEVEN)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _zero(**scale: Any) -> Any:
    config = {"device": torch.device("cpu"), "mixed_precision": torch.float16}
    wrapped = zero_model_wrapper(_model(), 3, config)
    return zero_optim_wrapper(wrapped, _adam(wrapped), **scale)


def _gemini_ddp() -> GeminiDDP:
    return GeminiDDP(_model(), placement_policy="cuda", mixed_precision=torch.float16)


def _gemini(**scale: Any) -> Any:
    model = _gemini_ddp()
    return GeminiOptimizer(_adam(model), model, **scale).engine


def _gemini_adam(**scale: Any) -> Any:
    return GeminiAdamOptimizer(_gemini_ddp(), lr=1e-3, **scale).engine


def _low_level(**scale: Any) -> Any:
    model = _model()
    return LowLevelZeroOptimizer(_adam(model), forced_dtype=torch.float16, **scale).engine


def _sharded_v2(**scale: Any) -> Any:
    model = ShardedModelV2(_model().half(), TensorShardStrategy())
    return ShardedOptimizerV2(model, _adam(model), **scale)


def _booster(plugin: Callable[..., Any]) -> Callable[..., Any]:
    def build(**scale: Any) -> Any:
        model = _model()
        booster = Booster(plugin=plugin(precision="fp16", **scale))
        _, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-3))
        return optimizer.engine

    return build


FRONT_DOORS: dict[str, Callable[..., Any]] = {
    "zero_optim_wrapper": _zero,
    "GeminiOptimizer": _gemini,
    "GeminiAdamOptimizer": _gemini_adam,
    "LowLevelZeroOptimizer": _low_level,
    "ShardedOptimizerV2": _sharded_v2,
    "GeminiPlugin": _booster(GeminiPlugin),
    "LowLevelZeroPlugin": _booster(lambda **kw: LowLevelZeroPlugin(stage=2, **kw)),
}
# Those that take the object too.
TAKE_THE_OBJECT = ("zero_optim_wrapper", "GeminiOptimizer", "GeminiAdamOptimizer")


def _settings(optimizer: Any) -> dict[str, Any]:
    scaler = optimizer.grad_scaler
    assert isinstance(scaler, DynamicGradScaler), type(scaler).__name__
    return {name: getattr(scaler, name) for name in SEVEN}


def _every_front_door() -> dict[str, dict[str, Any]]:
    seen = {name: _settings(build(**SEVEN)) for name, build in FRONT_DOORS.items()}
    for name in TAKE_THE_OBJECT:
        seen[f"{name}(loss_scale=...)"] = _settings(FRONT_DOORS[name](loss_scale=GIVEN))
        refined = FRONT_DOORS[name](loss_scale=GIVEN, growth_interval=11)
        seen[f"{name}(loss_scale=..., growth_interval=11)"] = _settings(refined)
    return seen


def test_the_seven_settings_reach_the_scaler_from_every_front_door() -> None:
    for seen in run_ranks(_every_front_door, 2):
        for name, settings in seen.items():
            expected = dict(SEVEN, growth_interval=11) if "=11" in name else SEVEN
            assert settings == expected, name


def test_the_adapters_take_the_seven_and_the_object() -> None:
    for strategy in (GeminiStrategy, FullyShardedStrategy):
        assert strategy(**SEVEN)._loss_scale == GIVEN
        assert strategy(loss_scale=GIVEN)._loss_scale == GIVEN
        assert strategy(loss_scale=GIVEN, hysteresis=5)._loss_scale == replace(GIVEN, hysteresis=5)
    # The callback names five of the seven; the object reaches all of them.
    five = {k: v for k, v in SEVEN.items() if k not in ("growth_factor", "backoff_factor")}
    assert ShardwiseCallback(**five).options.loss_scale == LossScaleConfig(**five)
    assert ShardwiseCallback(loss_scale=GIVEN).options.loss_scale == GIVEN


def test_one_translation() -> None:
    def front_door(initial_scale: float = 2**16, hysteresis: int = 2, **rest: Any) -> None:
        pass

    # The keywords a front door lacks keep LossScaleConfig's defaults.
    taken = loss_scale_from(front_door, {"initial_scale": 8.0, "hysteresis": 2, "other": 1})
    assert asdict(taken) == dict(asdict(LossScaleConfig()), initial_scale=8.0)
    # With the object, only keywords off their defaults refine it.
    refined = loss_scale_from(front_door, {"initial_scale": 2**16, "hysteresis": 4}, GIVEN)
    assert refined == replace(GIVEN, hysteresis=4)
    with pytest.raises(TypeError, match=r"loss_scale must be a shardwise.amp.LossScaleConfig"):
        loss_scale_from(front_door, {}, {"initial_scale": 8})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"growth_factor must be > 1, got 1.0"):
        loss_scale_from(front_door, {"initial_scale": 8.0}, replace(GIVEN, growth_factor=1.0))
