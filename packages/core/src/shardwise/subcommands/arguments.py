"""The command line's values read into what the code takes (sizes with a unit, counts, positive
ints, dtype names) and byte counts written back for people."""

from __future__ import annotations

import argparse
import math
import re

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_NUMBER = r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
# The command line's dtype names -> torch's (torch is imported where a command needs it, so
# that `shardwise --version` and `--help` answer at once).
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def size_in_bytes(text: str) -> int:
    """'80GB', '80 GiB', '512MiB', '1.5TB' -> bytes: a number and a unit, decimal (B, KB, MB,
    GB, TB) or binary (KiB, MiB, GiB, TiB), in any case. A bare number is refused: '80' is as
    likely meant in GB as in bytes."""
    match = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z]*)\s*", text)
    if match is None or (match.group(2) and match.group(2).upper() not in _UNITS):
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (examples: 80GB, 80GiB, 512MiB, 1.5TB)"
        )
    number, unit = match.groups()
    if not unit:
        raise argparse.ArgumentTypeError(
            f"{number} has no unit: write {number}GB or {number}GiB (or {number}B for bytes)"
        )
    nbytes = float(number) * _UNITS[unit.upper()]
    if not math.isfinite(nbytes):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} is too large")
    return int(nbytes)


def size_in_bytes_or_zero(text: str) -> int:
    """As `size_in_bytes`, and a bare 0 (none) too."""
    if re.fullmatch(rf"\s*{_NUMBER}\s*", text) and float(text) == 0:
        return 0
    return size_in_bytes(text)


def count(text: str) -> int:
    """'7.5e9', '125000000' -> a whole number."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not value.is_integer():
        raise argparse.ArgumentTypeError(
            f"not a count: {text!r} (a whole number, e.g. 7.5e9, 125000000)"
        )
    return int(value)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive int: {text!r} (e.g. 8)")
    return value


def gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB"
