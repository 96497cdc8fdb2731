"""Blockwise quantization of flat tensors for the wire: one byte per value, one fp32 scale per
block of values.

[Note: blockwise quantization]
A flat tensor of n values is cut into blocks of `block_numel` consecutive values (the last one
shorter when n is not a multiple). Each block is sent as its values divided by the block's
scale and narrowed to one byte, and the scale itself in fp32:
- int8: scale = absmax / 127 and q = round(x / scale), in [-127, 127]. The value decoded,
  q * scale, is within scale / 2 = absmax / 254 of x, plus the rounding of the division and of
  the product in fp32 (a few units in the last place of absmax) and, when decoded into a 16-bit
  buffer, that dtype's rounding of the result.
- fp8 (torch.float8_e4m3fn, 3 mantissa bits): scale = absmax / 448 (its largest finite value)
  and y = x / scale cast to e4m3 (round to nearest even). The decoded y * scale is within
  2^-4 |x| of x where |y| >= 2^-6 (e4m3's normal range), and within 2^-10 * scale below it (its
  subnormal spacing is 2^-9), plus the same fp32 and output rounding.
The absmax is taken over the block as it holds values (a tensor's padding is zeros, which
changes no absmax), so a block straddling two parameters is scaled by the larger of them:
blocks small against a layer (a few hundred values) keep a small parameter beside a large one
from losing its precision except where they meet.

Edge values:
- A block of zeros has scale 0 and decodes to zeros exactly (no 0 / 0).
- A block holding inf or nan is sent with a nan scale and zero values: all of it decodes to
  nan. A non-finite value is never turned into a finite one (e4m3 has no inf, and torch's CPU
  cast saturates inf to 448), so an fp16 overflow in a gradient reaches the rank that sums it,
  whose step finds it in the gradient norm, as it would unquantized; all of its block being nan
  changes nothing there, since a step with one non-finite value is skipped whole.
- A scale that underflows fp32 (absmax below about 1e-43) decodes its block to values within
  absmax of x, which is below fp32's smallest normal: nothing a gradient or weight carries.

A record is what one rank sends for n values, a byte (uint8) tensor: the n one-byte values,
padded to a multiple of 4 bytes, then the ceil(n / block_numel) scales, so the scales are read
in place as fp32 and the records of N ranks are one collective's N equal rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANTIZED_KINDS = ("int8", "fp8")
_LARGEST = {"int8": 127.0, "fp8": 448.0}
_WIRE_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def fp8_casts_work(device: torch.device) -> bool:
    """Whether this torch converts fp32 to and from `torch.float8_e4m3fn` on `device` (what the
    fp8 format needs of it)."""
    try:
        values = torch.tensor([1.5, -448.0, 0.0], device=device)
        back = values.to(torch.float8_e4m3fn).to(torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.equal(back, values))


@dataclass(frozen=True, slots=True)
class BlockQuantizer:
    """Blockwise quantization to one byte per value (see [Note: blockwise quantization]).

    Attributes:
        kind: "int8" (absmax int8) or "fp8" (e4m3 with a scale per block).
        block_numel: values per block, each with one fp32 scale.
    """

    kind: str
    block_numel: int

    def __post_init__(self) -> None:
        if self.kind not in QUANTIZED_KINDS:
            raise ValueError(f"a quantized format is one of {QUANTIZED_KINDS}, got {self.kind!r}")
        block = self.block_numel
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"quant_block_numel must be a positive int, got {block!r}")

    def num_blocks(self, numel: int) -> int:
        """Blocks (and scales) of a record of `numel` values."""
        return -(-numel // self.block_numel)

    def record_nbytes(self, numel: int) -> int:
        """Bytes of the record of `numel` values: the values padded to 4 bytes, then the
        scales."""
        return _values_nbytes(numel) + 4 * self.num_blocks(numel)

    def encode(self, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the record of the flat tensor `values` (any float dtype) into `out` (uint8,
        `record_nbytes(values.numel())` bytes) and return `out`."""
        numel = values.numel()
        assert out.dtype == torch.uint8 and out.numel() == self.record_nbytes(numel), out.shape
        block, full = self.block_numel, numel // self.block_numel
        x = values.reshape(-1).to(torch.float32)
        absmax = torch.empty(self.num_blocks(numel), dtype=torch.float32, device=values.device)
        if full:
            torch.amax(x[: full * block].view(full, block).abs(), dim=1, out=absmax[:full])
        if full * block < numel:
            absmax[full] = x[full * block :].abs().amax()
        scales = absmax / _LARGEST[self.kind]
        finite = torch.isfinite(scales)
        # Zero blocks divide by 1 (they stay zero); non-finite ones are zeroed below.
        divisor = torch.where(finite & (scales > 0), scales, torch.ones_like(scales))
        narrow = out[:numel].view(_WIRE_DTYPE[self.kind])
        for begin, end, rows in self._spans(numel):
            y = x[begin:end].view(rows, -1) / divisor[_blocks(begin, block, rows)].unsqueeze(1)
            y.masked_fill_(~finite[_blocks(begin, block, rows)].unsqueeze(1), 0.0)
            if self.kind == "int8":
                y.round_()
            y.clamp_(-_LARGEST[self.kind], _LARGEST[self.kind])
            narrow[begin:end].view(rows, -1).copy_(y)
        scales.masked_fill_(~finite, float("nan"))
        self._scales(out.view(1, -1), numel)[0].copy_(scales)
        return out

    def decode(self, records: torch.Tensor, out: torch.Tensor) -> None:
        """Fill `out` (R rows of n values, any float dtype) from `records` (R rows of
        `record_nbytes(n)` bytes): row r of `out` from record r."""
        rows_out, numel = out.shape
        assert records.dtype == torch.uint8, records.dtype
        assert records.shape == (rows_out, self.record_nbytes(numel)), records.shape
        narrow = records[:, :numel].view(_WIRE_DTYPE[self.kind])
        scales = self._scales(records, numel)
        block = self.block_numel
        for begin, end, rows in self._spans(numel):
            target = out[:, begin:end].unflatten(-1, (rows, -1))
            # Narrow values are exact in every float dtype; one rounding in the product.
            target.copy_(narrow[:, begin:end].unflatten(-1, (rows, -1)))
            target.mul_(scales[:, _blocks(begin, block, rows)].unsqueeze(-1))

    def round_trip(self, values: torch.Tensor) -> torch.Tensor:
        """`values` encoded and decoded, in fp32: what a rank receiving them computes with."""
        record = torch.empty(
            self.record_nbytes(values.numel()), dtype=torch.uint8, device=values.device
        )
        out = torch.empty(1, values.numel(), dtype=torch.float32, device=values.device)
        self.decode(self.encode(values, record).view(1, -1), out)
        return out.view(values.shape)

    def _spans(self, numel: int) -> list[tuple[int, int, int]]:
        """(begin, end, blocks) of the whole blocks and of the shorter last one."""
        block, full = self.block_numel, numel // self.block_numel
        spans = [(0, full * block, full)] if full else []
        if full * block < numel:
            spans.append((full * block, numel, 1))
        return spans

    def _scales(self, records: torch.Tensor, numel: int) -> torch.Tensor:
        begin = _values_nbytes(numel)
        return records[:, begin : begin + 4 * self.num_blocks(numel)].view(torch.float32)


def _blocks(begin: int, block_numel: int, rows: int) -> slice:
    """The blocks (scales) of `rows` blocks starting at value `begin`."""
    first = begin // block_numel
    return slice(first, first + rows)


def _values_nbytes(numel: int) -> int:
    return -(-numel // 4) * 4
