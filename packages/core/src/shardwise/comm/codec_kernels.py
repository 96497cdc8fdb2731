"""The elementwise work of blockwise quantization (comm/quantize.py): three functions over
whole blocks, run compiled where a tensor is large enough to repay compiling them.

[Note: compiled codecs]
Eager torch encodes a block in about eight passes over its values (abs, the per-block max,
divide, mask, round, clamp, narrow), and its reduction of short rows is the slowest of them.
Measured on a 2-core host (64 MiB fp32 shard, one thread): eager encoding took 241-390 ms,
while gloo all-gathered the same 64 MiB in 375 ms and its int8 record in 96 ms, so encoding
cost what the bytes saved it. `torch.compile` (inductor: a C++ loop on the CPU, Triton on a
GPU) fuses each function below into one pass: 26 ms to encode, 27 ms to decode, 25 ms to
decode and add, against 390 / 140 / 135 ms eager in the same run.

The compiled and the eager functions are the same expressions of correctly rounded operations
(division, round half to even, the fp32 product and sum, the casts), so on the CPU they give
the same bits (tests/unit/test_codec_kernels.py compares them on edge values); a GPU's
compiler may contract a product and a sum into one rounding, within fp32's rounding of the
eager result. Eagerly, a device encodes the host's bits (tests/gpu/test_cuda.py) only because
the scale divides by a tensor: CUDA's division by a host scalar multiplies by its reciprocal,
which rounds twice and differed from the host in the last bit of most scales on an H200.

Compiling costs seconds, once per process and function (less where inductor's on-disk cache
already holds it), which a large chunk repays in its first steps and a small one never does:
only calls over at least `COMPILE_MIN_NUMEL` values run compiled. Where compiling fails (no C++
compiler, a device inductor does not serve), a warning says so once and the eager functions
run: the same values, slower. `TORCHDYNAMO_DISABLE=1`, torch's own switch, runs them eagerly
too.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

COMPILE_MIN_NUMEL = 1 << 20
"""Values a call must cover to run compiled (see [Note: compiled codecs])."""

_RECOMPILE_LIMIT = 64
_log = logging.getLogger(__name__)


def encode_blocks(
    values: torch.Tensor,
    narrow: torch.Tensor,
    scales_out: torch.Tensor,
    largest: float,
    rounded: bool,
) -> None:
    """Quantize `values` (rows x block, any float dtype) into `narrow` (rows x block, the wire
    dtype, or int8 levels) and their scales into `scales_out` (rows, fp32): scale = absmax /
    `largest`, values divided by it, rounded to integers where `rounded`, clamped to
    +-`largest`. A zero block divides by 1 (it stays zero); a block holding inf or nan is sent
    as zeros with a nan scale (see [Note: blockwise quantization] in comm/quantize.py)."""
    x = values.to(torch.float32)
    absmax = x.abs().amax(dim=1)
    # A tensor divisor, not the number: CUDA divides by a host scalar as a product with its
    # reciprocal, a second rounding the CPU does not make (see [Note: compiled codecs]).
    scales = absmax / torch.full_like(absmax, largest)
    finite = torch.isfinite(scales)
    divisor = torch.where(finite & (scales > 0), scales, torch.ones_like(scales))
    y = torch.where(finite.unsqueeze(1), x / divisor.unsqueeze(1), 0.0)
    if rounded:
        y = torch.round(y)
    narrow.copy_(torch.clamp(y, -largest, largest))
    scales_out.copy_(torch.where(finite, scales, float("nan")))


def decode_blocks(narrow: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Write `narrow` (rows x block, one-byte values or int8 levels) times its `scales`
    (rows, fp32) into `out` (rows x block, any float dtype): the narrow values are exact in
    fp32, so the product is the one rounding (and `out`'s dtype the other)."""
    out.copy_(narrow.to(torch.float32) * scales.unsqueeze(1))


def add_decoded_blocks(narrow: torch.Tensor, scales: torch.Tensor, total: torch.Tensor) -> None:
    """Add `narrow` times its `scales`, decoded as `decode_blocks` decodes them, to `total`
    (rows x block, fp32): the product rounded to fp32, then the sum."""
    total.add_(narrow.to(torch.float32) * scales.unsqueeze(1))


_compiled: dict[Callable[..., None], Callable[..., None]] = {}
_eager_only: set[Callable[..., None]] = set()


def run(kernel: Callable[..., None], *args: Any) -> None:
    """Run `kernel` (one of the functions above) on `args`, compiled when its first tensor has
    at least `COMPILE_MIN_NUMEL` values (see [Note: compiled codecs])."""
    first: torch.Tensor = args[0]
    if first.numel() < COMPILE_MIN_NUMEL or kernel in _eager_only:
        kernel(*args)
        return
    compiled = _compiled.get(kernel)
    if compiled is None:
        _log.info("compiling the wire codec's %s (once per process)", kernel.__name__)
        compiled = torch.compile(kernel, dynamic=True, fullgraph=True)
        _compiled[kernel] = compiled
    try:
        # Each input and output dtype, and a block count of one, is a graph of its own: more
        # than dynamo's default of 8 per function where a run mixes formats and dtypes.
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            compiled(*args)
    except Exception as error:  # any compiler failure falls back to eager
        _eager_only.add(kernel)
        warnings.warn(
            f"compiling the wire codec's {kernel.__name__} failed ({type(error).__name__}: "
            f"{error}); it runs eagerly in this process: the same values, slower",
            RuntimeWarning,
            stacklevel=2,
        )
        kernel(*args)
