"""A progress bar on rank 0 for work that takes minutes in one call: a checkpoint's save or
load, the disk tier's first write of every master and state.

[Note: when the bar shows]
Rank 0 draws one tqdm bar on stderr for the work of its own share (every rank does about as
much); the other ranks draw none, so a terminal shows one bar, not one per rank. Whether it
shows is decided once, where the work starts, on every rank alike:
- a `progress=` argument, where the call takes one (True: show, False: do not);
- else the environment variable SHARDWISE_PROGRESS: 1 / true / on shows it whatever stderr
  is (a log captured to a file gets the bar's lines), 0 / false / off never;
- else it shows when stderr is a terminal, so batch jobs' logs stay clean.
The INFO log lines the work writes besides (at each tenth, on every rank) do not depend on it.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
from tqdm import tqdm

ENV_VAR = "SHARDWISE_PROGRESS"
_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def progress_wanted(progress: bool | None = None) -> bool:
    """Whether this process draws progress bars (see [Note: when the bar shows]): `progress`
    when given, else SHARDWISE_PROGRESS when set, else whether stderr is a terminal; and only
    on rank 0 (or without a process group).

    Args:
        progress: True or False to decide here; None to follow the environment variable, then
            the terminal.

    Raises ValueError, naming the value, where `progress` is not a bool or None or the
    environment variable is none of its spellings.
    """
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"progress must be True, False or None, got {progress!r}")
    if progress is None:
        progress = _from_environment()
    if progress is None:
        progress = _stderr_is_terminal()
    distributed = dist.is_available() and dist.is_initialized()
    return progress and (not distributed or dist.get_rank() == 0)


def progress_bar(total: int, description: str, *, shown: bool, unit: str = "B") -> tqdm:
    """A tqdm bar on stderr counting to `total`, drawn only where `shown` (a disabled bar
    takes `update` and `close` and draws nothing).

    Args:
        total: the work's size, in `unit`s.
        description: what the work is, at the bar's left ("checkpoint save").
        shown: the caller's `progress_wanted()`.
        unit: "B" counts bytes (shown in KiB, MiB, GiB); any other unit is shown as counted.
    """
    in_bytes = unit == "B"
    return tqdm(
        total=total,
        desc=description,
        unit=unit,
        unit_scale=in_bytes,
        unit_divisor=1024 if in_bytes else 1000,
        disable=not shown,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=True,
    )


def _from_environment() -> bool | None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not understood: set it to 1 (show progress bars on "
        f"rank 0 whatever stderr is) or 0 (never), or unset it (show them when stderr is a "
        f"terminal)"
    )


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False
