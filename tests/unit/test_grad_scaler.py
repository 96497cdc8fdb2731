"""The loss scalers' arithmetic, bounds, validation and saved state."""

from __future__ import annotations

import json

import pytest

from shardwise import ConstantGradScaler, DynamicGradScaler


def test_hysteresis_then_backoff_on_each_further_overflow() -> None:
    scaler = DynamicGradScaler(initial_scale=1024, hysteresis=2)
    scales = []
    for _ in range(3):
        scaler.update(True)
        scales.append(scaler.scale)
    assert scales == [1024, 512, 256]
    assert scaler.num_overflows == 3


def test_growth_after_interval_resets_hysteresis() -> None:
    scaler = DynamicGradScaler(initial_scale=8, growth_interval=3, hysteresis=2)
    scaler.update(True)
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 16
    assert scaler.hysteresis_step == 0
    scaler.update(True)  # counts against a fresh hysteresis: no backoff yet
    assert scaler.scale == 16


def test_bounds_clamp() -> None:
    scaler = DynamicGradScaler(
        initial_scale=4, min_scale=2, max_scale=8, growth_interval=1, hysteresis=1
    )
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 8
    for _ in range(3):
        scaler.update(True)
    assert scaler.scale == 2


@pytest.mark.parametrize(
    ("kwargs", "kind", "pattern"),
    [
        ({"backoff_factor": 1.5}, ValueError, "backoff_factor must be in \\(0, 1\\), got 1.5"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor must be > 1, got 1.0"),
        ({"growth_interval": 0}, ValueError, "growth_interval must be >= 1, got 0"),
        ({"hysteresis": True}, TypeError, "hysteresis must be an int"),
        ({"initial_scale": "big"}, TypeError, "initial_scale must be a number"),
        ({"initial_scale": float("inf")}, ValueError, "initial_scale must be finite"),
        ({"min_scale": 0}, ValueError, "min_scale must be > 0, got 0"),
        ({"initial_scale": 2.0**40}, ValueError, "min_scale <= initial_scale <= max_scale"),
    ],
)
def test_validation(kwargs: dict[str, object], kind: type[Exception], pattern: str) -> None:
    with pytest.raises(kind, match=pattern):
        DynamicGradScaler(**kwargs)  # type: ignore[arg-type]


def test_state_round_trip_continues_identically() -> None:
    pattern = [False, True, False, False, True, True, False, False, False, True]
    original = DynamicGradScaler(initial_scale=64, growth_interval=2, hysteresis=2)
    for overflow in pattern[:5]:
        original.update(overflow)
    state = json.loads(json.dumps(original.state_dict()))
    resumed = DynamicGradScaler(initial_scale=2, growth_interval=100)
    resumed.load_state_dict(state)
    for overflow in pattern[5:]:
        original.update(overflow)
        resumed.update(overflow)
        assert resumed.scale == original.scale
    assert resumed.state_dict() == original.state_dict()


def test_load_of_incomplete_state_names_the_key() -> None:
    state = DynamicGradScaler().state_dict()
    del state["hysteresis_step"]
    with pytest.raises(ValueError, match="hysteresis_step"):
        DynamicGradScaler().load_state_dict(state)


def test_constant_scaler_never_moves_but_counts() -> None:
    scaler = ConstantGradScaler()
    scaler.update(True)
    scaler.update(False)
    assert scaler.scale == 1.0
    assert (scaler.num_steps, scaler.num_overflows) == (2, 1)
