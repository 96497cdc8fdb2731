"""Loss scalers: a constant one, and the dynamic one fp16 training needs."""

from __future__ import annotations

import abc
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

_DYNAMIC_KEYS = (
    "scale",
    "growth_step",
    "hysteresis_step",
    "num_overflows",
    "num_steps",
    "initial_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
)


class GradScaler(abc.ABC):
    """What the ZeRO optimizers call: the current scale, and an update after every step."""

    def __init__(self) -> None:
        self.num_overflows = 0
        self.num_steps = 0

    @property
    @abc.abstractmethod
    def scale(self) -> float:
        """The current loss scale."""

    @abc.abstractmethod
    def update(self, overflow: bool) -> None:
        """Record one step, `overflow` telling whether any rank's gradient was inf or nan."""

    @property
    def can_back_off(self) -> bool:
        """Whether an overflow now lowers the scale: if not, a skipped step changes nothing
        for the next one."""
        return False

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def _count(self, overflow: bool) -> None:
        self.num_steps += 1
        if overflow:
            self.num_overflows += 1


def _check_number(owner: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: {name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be finite, got {value}")
    return float(value)


def _check_count(owner: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{owner}: {name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaleConfig:
    """The dynamic loss scale's settings, validated once (the seeds' seven loss-scale
    arguments, which every entry point takes, become this).

    See `DynamicGradScaler` for how they act together.
    """

    initial_scale: float = 2**16
    """The scale of the first step."""
    growth_factor: float = 2.0
    """Factor > 1 applied after `growth_interval` clean steps in a row."""
    backoff_factor: float = 0.5
    """Factor in (0, 1) applied on overflow once the hysteresis is used up."""
    growth_interval: int = 1000
    """Clean steps between growths, >= 1."""
    hysteresis: int = 2
    """Overflows tolerated before backing off, >= 1."""
    min_scale: float = 1.0
    """Lower bound, > 0."""
    max_scale: float = 2**32
    """Upper bound, >= initial_scale."""

    def __post_init__(self) -> None:
        owner = "DynamicGradScaler"
        for name in ("initial_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            _check_number(owner, name, getattr(self, name))
        for name in ("growth_interval", "hysteresis"):
            _check_count(owner, name, getattr(self, name))
        if self.growth_factor <= 1:
            raise ValueError(f"{owner}: growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"{owner}: backoff_factor must be in (0, 1), got {self.backoff_factor}"
            )
        if self.min_scale <= 0:
            raise ValueError(f"{owner}: min_scale must be > 0, got {self.min_scale}")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(
                f"{owner}: need min_scale <= initial_scale <= max_scale, got {self.min_scale}, "
                f"{self.initial_scale}, {self.max_scale}"
            )


_SETTINGS = tuple(f.name for f in fields(LossScaleConfig))
# ColossalAI's seven loss-scale keywords, every front door's names for LossScaleConfig's fields.
LOSS_SCALE_KEYWORDS: tuple[str, ...] = _SETTINGS


def loss_scale_from(
    front_door: Callable[..., Any],
    arguments: Mapping[str, Any],
    given: LossScaleConfig | None = None,
) -> LossScaleConfig:
    """ColossalAI's loss-scale keywords, as a front door took them, as one `LossScaleConfig`:
    the one translation of them, which every front door makes (and passes the object on).

    Args:
        front_door: the function (or `__init__`) whose arguments they are; its signature's
            defaults tell which keywords were given.
        arguments: its arguments by name (its `locals()` on entry); the keywords it takes
            are read, those it lacks keep LossScaleConfig's defaults.
        given: a `loss_scale=` argument, or None. Its settings stand where the keywords are
            left at their defaults; a keyword given another value refines it, as arguments
            refine an `engine_config`.
    """
    if given is not None and not isinstance(given, LossScaleConfig):
        raise TypeError(
            f"loss_scale must be a shardwise.amp.LossScaleConfig or None, got "
            f"{type(given).__name__} {given!r}"
        )
    taken = {name: arguments[name] for name in LOSS_SCALE_KEYWORDS if name in arguments}
    if given is None:
        return LossScaleConfig(**taken)
    signature = inspect.signature(front_door).parameters
    refined = {
        name: value
        for name, value in taken.items()
        if name not in signature or value != signature[name].default
    }
    return replace(given, **refined)


class ConstantGradScaler(GradScaler):
    """A scale that never changes (fp32 and bf16 training use 1.0); overflows are counted.

    Args:
        scale: the loss scale, > 0.
    """

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        value = _check_number("ConstantGradScaler", "scale", scale)
        if value <= 0:
            raise ValueError(f"ConstantGradScaler: scale must be > 0, got {scale}")
        self._scale = value

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> None:
        self._count(overflow)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "constant",
            "scale": self._scale,
            "num_overflows": self.num_overflows,
            "num_steps": self.num_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "constant":
            raise ValueError(f"not a ConstantGradScaler state: kind={state.get('kind')!r}")
        for key in ("scale", "num_overflows", "num_steps"):
            if key not in state:
                raise ValueError(f"ConstantGradScaler state is missing {key!r}")
        self._scale = float(state["scale"])
        self.num_overflows = int(state["num_overflows"])
        self.num_steps = int(state["num_steps"])

    def __repr__(self) -> str:
        return (
            f"ConstantGradScaler(scale={self._scale}, steps={self.num_steps}, "
            f"overflows={self.num_overflows})"
        )


class DynamicGradScaler(GradScaler):
    """Loss scale that backs off on overflow and grows after a run of clean steps.

    On an overflow the hysteresis counter rises and the growth counter resets; once the counter
    reaches `hysteresis`, this and every further overflow multiply the scale by
    `backoff_factor` (never below `min_scale`). After `growth_interval` clean steps in a row the
    scale is multiplied by `growth_factor` (never above `max_scale`) and the hysteresis counter
    resets.

    Args:
        initial_scale: starting scale.
        growth_factor: factor > 1 applied after `growth_interval` clean steps.
        backoff_factor: factor in (0, 1) applied on overflow once hysteresis is used up.
        growth_interval: clean steps between growths, >= 1.
        hysteresis: overflows tolerated before backing off, >= 1.
        min_scale: lower bound, > 0.
        max_scale: upper bound, >= initial_scale.
    """

    def __init__(
        self,
        initial_scale: float = 2**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        max_scale: float = 2**32,
    ) -> None:
        super().__init__()
        self._settle(loss_scale_from(DynamicGradScaler.__init__, locals()))
        self._scale = self.initial_scale
        self.growth_step = 0
        self.hysteresis_step = 0

    @classmethod
    def from_config(cls, config: LossScaleConfig) -> DynamicGradScaler:
        return cls(**asdict(config))

    def _settle(self, config: LossScaleConfig) -> None:
        self.initial_scale = float(config.initial_scale)
        self.growth_factor = float(config.growth_factor)
        self.backoff_factor = float(config.backoff_factor)
        self.growth_interval = config.growth_interval
        self.hysteresis = config.hysteresis
        self.min_scale = float(config.min_scale)
        self.max_scale = float(config.max_scale)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def can_back_off(self) -> bool:
        return self._scale > self.min_scale

    def update(self, overflow: bool) -> None:
        self._count(overflow)
        if overflow:
            self.hysteresis_step += 1
            self.growth_step = 0
            if self.hysteresis_step >= self.hysteresis:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_step += 1
            if self.growth_step == self.growth_interval:
                self.growth_step = 0
                self.hysteresis_step = 0
                self._scale = min(self._scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "dynamic",
            "scale": self._scale,
            "growth_step": self.growth_step,
            "hysteresis_step": self.hysteresis_step,
            "num_overflows": self.num_overflows,
            "num_steps": self.num_steps,
            "initial_scale": self.initial_scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "dynamic":
            raise ValueError(f"not a DynamicGradScaler state: kind={state.get('kind')!r}")
        for key in _DYNAMIC_KEYS:
            if key not in state:
                raise ValueError(f"DynamicGradScaler state is missing {key!r}")
        # The saved settings, validated as the constructor's are.
        self._settle(LossScaleConfig(**{k: state[k] for k in _SETTINGS}))
        self._scale = float(state["scale"])
        self.growth_step = int(state["growth_step"])
        self.hysteresis_step = int(state["hysteresis_step"])
        self.num_overflows = int(state["num_overflows"])
        self.num_steps = int(state["num_steps"])

    def __repr__(self) -> str:
        return (
            f"DynamicGradScaler(scale={self._scale}, growth_step={self.growth_step}, "
            f"hysteresis_step={self.hysteresis_step}, overflows={self.num_overflows})"
        )
