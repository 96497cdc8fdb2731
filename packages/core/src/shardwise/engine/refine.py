"""An entry point's own arguments refining a user's `EngineConfig`, on the device and in the
precision its framework gives each rank (see [Note: engine_config and the arguments that
refine it]).

[Note: engine_config and the arguments that refine it]
The adapters (Lightning's strategies, the Trainer callback) take a typed `engine_config=`, so
every setting of the engine is reachable from them, the ones added later included, with no
plumbing per setting. Their own arguments (the names of Lightning's former strategies, the
callback's) refine it, setting by setting: an argument left at its default keeps
engine_config's value; one given another value replaces the settings it translates to (a field
of `EngineConfig` or of one of its parts), and only those. Which settings an argument
translates to is read off the entry point's own translation: it translates all of its
arguments (`asked`) and its defaults (`defaults`), and every setting where the two differ is an
argument's (`refine`). Without engine_config the entry point's defaults are the base, as
before.

Two settings come from the framework, not from engine_config. The device: each rank computes
on the one its framework gives it, which must be of the type engine_config names (its index is
the rank's own). The storage dtype: `Trainer(precision=...)`, TrainingArguments' fp16 / bf16;
engine_config.precision at its default takes it, any other must store in it, and its compute
and reduction dtypes stand. Then the device rules (engine/devices.py) fill what nobody asked:
the compute dtype on a CPU, pinning of host copies (without engine_config), and "auto"
placement where no budget can be read (`gemini.manager.placement_on`). Every refusal is the
config parts' own, raised as the whole is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch

from shardwise.engine.config import EngineConfig, MixedPrecision, storage_precision
from shardwise.engine.devices import pins_host_copies
from shardwise.gemini.manager import placement_on

# An entry point's arguments translated: EngineConfig's field names to their values (a config
# part such as `Placement`, or a plain setting such as `force_outputs_fp32`).
Parts = Mapping[str, Any]


def defaults_of(function: Callable[..., Any]) -> dict[str, Any]:
    """The default of each parameter of `function` that has one, by name."""
    return {
        name: parameter.default
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }


def translated(translate: Callable[..., Parts], arguments: Mapping[str, Any]) -> Parts:
    """`translate` (an entry point's translation, whose parameters are some of its arguments)
    called with those of `arguments` it takes."""
    names = inspect.signature(translate).parameters
    return translate(**{name: arguments[name] for name in names})


def checked_engine_config(value: object, caller: str) -> EngineConfig | None:
    """`value` as an `engine_config=` argument: an EngineConfig or None, else a TypeError."""
    if value is None or isinstance(value, EngineConfig):
        return value
    raise TypeError(
        f"{caller}: engine_config must be a shardwise.EngineConfig or None, got "
        f"{type(value).__name__} {value!r}; build one with EngineConfig(stage=3, "
        f"device=torch.device('cpu'), placement=Placement(...), ...)"
    )


def refine(base: EngineConfig, asked: Parts, defaults: Parts) -> EngineConfig:
    """`base` with every setting that `asked` gives otherwise than `defaults` taken from
    `asked`, a part's fields one by one (see [Note: engine_config and the arguments that
    refine it]); the whole is validated once, as it is built.

    Args:
        base: the configuration refined (engine_config).
        asked: the entry point's arguments translated.
        defaults: the entry point's default arguments translated (the same keys).
    """
    changes: dict[str, Any] = {}
    for name, value in asked.items():
        default = defaults[name]
        if _is_part(value) and type(value) is type(default):
            changed = {
                field.name: getattr(value, field.name)
                for field in fields(value)
                if getattr(value, field.name) != getattr(default, field.name)
            }
            if changed:
                changes[name] = replace(getattr(base, name), **changed)
        elif value != default:
            changes[name] = value
    return replace(base, **changes) if changes else base


def framework_config(
    engine_config: EngineConfig | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    asked: Parts,
    defaults: Parts,
    caller: str,
    precision_setting: str,
) -> EngineConfig:
    """The configuration an adapter's rank runs: `engine_config` (or the adapter's defaults)
    on `device`, storing parameters in `dtype`, refined by the adapter's arguments, with the
    device rules applied (see [Note: engine_config and the arguments that refine it]).

    Args:
        engine_config: the user's configuration, or None.
        device: the device the framework gives this rank.
        dtype: the storage dtype the framework's precision asks for.
        asked, defaults: the adapter's arguments, and its default arguments, translated
            (`refine`); `defaults` holds "stage" where the adapter has no stage argument.
        caller: the entry point named in errors.
        precision_setting: where the framework's precision was set, named in errors
            (e.g. "Trainer(precision='bf16-mixed')").
    """
    if engine_config is None:
        rest = {name: value for name, value in defaults.items() if name != "precision"}
        base = EngineConfig(device=device, **rest)
        base = replace(base, placement=replace(base.placement, pin_memory=pins_host_copies(device)))
    else:
        if engine_config.device.type != device.type:
            raise ValueError(
                f"{caller}: engine_config.device is {engine_config.device}, but this rank "
                f"computes on {device}, as its framework placed it: build the EngineConfig "
                f"with device=torch.device({device.type!r}) (each rank then computes on its "
                f"own {device.type} device)"
            )
        base = engine_config
    precision = _precision(base.precision, dtype, device, caller, precision_setting)
    config = refine(replace(base, device=device, precision=precision), asked, defaults)
    placement = config.placement
    policy = placement_on(placement.policy, device, placement.device_budget_bytes)
    if policy is not placement.policy:
        config = replace(config, placement=replace(placement, policy=policy))
    return config


def _precision(
    given: MixedPrecision,
    dtype: torch.dtype,
    device: torch.device,
    caller: str,
    setting: str,
) -> MixedPrecision:
    """engine_config's dtypes under the framework's storage `dtype`: its default takes the
    framework's, with the device's compute dtype; another must store in `dtype`."""
    if given == MixedPrecision():
        return storage_precision(dtype, device)
    if given.param_dtype != dtype:
        raise ValueError(
            f"{caller}: engine_config.precision stores parameters in {given.param_dtype}, but "
            f"{setting} asks for {dtype}: make the two agree, or leave engine_config.precision "
            f"at its default (MixedPrecision()) to take {setting}'s dtypes"
        )
    return storage_precision(
        dtype, device, compute_dtype=given.compute_dtype, reduce_dtype=given.reduce_dtype
    )


def _is_part(value: object) -> bool:
    return is_dataclass(value) and not isinstance(value, type)
