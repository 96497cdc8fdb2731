"""`shardwise plan --model`: the model built on the meta device (sizes without allocation) and
read into the planner's ModelSpec."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from shardwise.planner import ModelSpec

MODEL_FORM = "package.module:factory, a callable building the model with no arguments"
_MISSING = object()


def one_line(error: BaseException) -> str:
    """The error's type and the first line of its message: what a refusal quotes of what the
    user's code raised."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def meta_model(target: str) -> nn.Module:
    """Build `package.module:factory` on the meta device (sizes without allocation).

    Raises ValueError, naming `target` and what was expected, where it builds no module."""
    import torch

    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--model must be {MODEL_FORM}; got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # whatever the user's module raises while importing
        raise ValueError(
            f"--model {target!r}: module {module_name!r} does not import ({one_line(error)}); "
            f"expected {MODEL_FORM}, its module installed or on PYTHONPATH"
        ) from None
    factory = getattr(module, attribute, _MISSING)
    if factory is _MISSING or not callable(factory):
        found = "has no" if factory is _MISSING else "has a non-callable"
        raise ValueError(
            f"--model {target!r}: module {module_name!r} {found} attribute {attribute!r}; "
            f"expected {MODEL_FORM}"
        )
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:  # whatever the user's factory raises
        raise ValueError(
            f"--model {target!r}: {attribute}() raised {one_line(error)}; expected it to build "
            f"the model with no arguments on the meta device (no weights loaded, no .to(device))"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"--model {target!r}: {attribute}() returned {type(model).__name__}, expected a "
            f"torch.nn.Module"
        )
    return model


def model_spec(model: nn.Module, target: str) -> ModelSpec:
    """The planner's ModelSpec of `model`; a model it cannot read is refused naming `target`."""
    from shardwise.planner import ModelSpec

    try:
        return ModelSpec.from_module(model)
    except ValueError as error:
        raise ValueError(f"--model {target!r}: {error}") from None
