"""Blockwise quantization of flat tensors for the wire: one byte (int8, fp8) or half a byte
(int4) per value, one fp32 scale per block of values.

[Note: blockwise quantization]
A flat tensor of n values is cut into blocks of `block_numel` consecutive values (the last one
shorter when n is not a multiple). Each block is sent as its values divided by the block's
scale and narrowed to one byte (int4: half a byte), and the scale itself in fp32:
- int8: scale = absmax / 127 and q = round(x / scale), in [-127, 127]. The value decoded,
  q * scale, is within scale / 2 = absmax / 254 of x, plus the rounding of the division and of
  the product in fp32 (a few units in the last place of absmax) and, when decoded into a 16-bit
  buffer, that dtype's rounding of the result.
- fp8 (torch.float8_e4m3fn, 3 mantissa bits): scale = absmax / 448 (its largest finite value)
  and y = x / scale cast to e4m3 (round to nearest even). The decoded y * scale is within
  2^-4 |x| of x where |y| >= 2^-6 (e4m3's normal range), and within 2^-10 * scale below it (its
  subnormal spacing is 2^-9), plus the same fp32 and output rounding.
- int4 (gradient reductions only: see [Note: int4 is for gradients]): scale = absmax / 7 and
  q = round(x / scale), in [-7, 7], within scale / 2 = absmax / 14 of x, plus the same fp32 and
  output rounding. The range is symmetric, as int8's is: the block's largest magnitude is a
  level whatever its sign, and -x is sent as the negation of x, so rounding has no bias to one
  sign that a sum over ranks could accumulate. Two's complement's -8 would be a level only
  below zero: reaching it with scale = absmax / 8 leaves +absmax at 8, out of range (clamped,
  an error of a whole step), and with scale = absmax / 7 it is never reached; it is given up
  (15 of 16 codes used, 0.1 bit).
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

The elementwise work (the per-block absmax, the division, rounding and narrowing, and the
product decoding) runs in comm/codec_kernels.py, compiled for large tensors (see [Note:
compiled codecs] there).

A record is what one rank sends for n values, a byte (uint8) tensor: the n one-byte values
(int4: the n values packed two to a byte, see [Note: int4 packing]), padded to a multiple of 4
bytes, then the ceil(n / block_numel) scales, so the scales are read in place as fp32 and the
records of N ranks are one collective's N equal rows.

[Note: int4 packing]
Value i of a record is the low half of byte i // 2 when i is even and its high half when i is
odd, as q + 8 (offset binary, 1 to 15); the packing runs over the record's values whatever the
blocks, so a block of odd length (or one straddling two parameters) starts mid-byte like any
other value. Every half byte of the values' bytes is written: those past the n values (the high
half of the last byte for odd n, and the bytes padding to 4) hold 8, a zero, so a record's bytes
are a function of its values alone. Unpacking is exact: the levels come back as they were.

[Note: int4 is for gradients]
ZeRO++ sends weights in int8 (qwZ) and gradients in int4 (qgZ). A gathered weight is computed
with by the ranks that decode it, so its error (absmax / 14 of its block, 7% of the block's
largest weight) would enter every forward and backward; a gradient's enters once, as one
of N contributions to an fp32 sum that the optimizer then averages over steps. So int4 is
offered for `reduce_format` and refused for `gather_format`, naming int8
(`check_wire_formats` below, which `Communication` and the planner call, and `WireFormats`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardwise.comm import codec_kernels

QUANTIZED_KINDS = ("int8", "fp8", "int4")
GATHER_KINDS = ("int8", "fp8")
"""The kinds a parameter gather may send (see [Note: int4 is for gradients])."""
DEFAULT_QUANT_BLOCK_NUMEL = 256
GATHER_FORMATS = ("dtype", *GATHER_KINDS)
REDUCE_FORMATS = ("dtype", *QUANTIZED_KINDS)
_LARGEST = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
_WIRE_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # int4: packed, no dtype
_ROUNDED = ("int8", "int4")
_INT4_ZERO = 8  # the offset of [Note: int4 packing]


def fp8_casts_work(device: torch.device) -> bool:
    """Whether this torch converts fp32 to and from `torch.float8_e4m3fn` on `device` (what the
    fp8 format needs of it)."""
    try:
        values = torch.tensor([1.5, -448.0, 0.0], device=device)
        back = values.to(torch.float8_e4m3fn).to(torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.equal(back, values))


def check_wire_formats(gather: object, reduce: object, block_numel: object) -> None:
    """Refuse wire formats that do not exist, naming the `gemini_config` keys users set:
    `gather` one of GATHER_FORMATS, `reduce` one of REDUCE_FORMATS ("dtype": unquantized),
    `block_numel` a positive int."""
    if gather == "int4":
        raise ValueError(
            "gather_format='int4' is not offered: int4 quantizes gradient reductions only "
            "(reduce_format='int4'); gather parameters in 'int8' (ZeRO++'s qwZ sends weights "
            "in int8) or 'fp8'"
        )
    for key, value, formats in (
        ("gather_format", gather, GATHER_FORMATS),
        ("reduce_format", reduce, REDUCE_FORMATS),
    ):
        if not isinstance(value, str):
            raise TypeError(
                f"{key} must be a str, one of {formats}, got {type(value).__name__} {value!r}"
            )
        if value not in formats:
            raise ValueError(f"{key} must be one of {formats}, got {value!r}")
    if isinstance(block_numel, bool) or not isinstance(block_numel, int):
        raise TypeError(
            "quant_block_numel must be a positive int (values per fp32 scale), got "
            f"{type(block_numel).__name__} {block_numel!r}"
        )
    if block_numel < 1:
        raise ValueError(f"quant_block_numel must be a positive int, got {block_numel!r}")


@dataclass(frozen=True, slots=True)
class BlockQuantizer:
    """Blockwise quantization to one byte, or half a byte, per value (see [Note: blockwise
    quantization]).

    Attributes:
        kind: "int8" (absmax int8), "fp8" (e4m3 with a scale per block) or "int4" (absmax
            int4 in [-7, 7], two values a byte: see [Note: int4 packing]).
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
        """Bytes of the record of `numel` values: the values (int4: two a byte) padded to 4
        bytes, then the scales."""
        return self._values_nbytes(numel) + 4 * self.num_blocks(numel)

    def encode(self, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the record of the flat tensor `values` (any float dtype) into `out` (uint8,
        `record_nbytes(values.numel())` bytes) and return `out`."""
        numel = values.numel()
        assert out.dtype == torch.uint8 and out.numel() == self.record_nbytes(numel), out.shape
        x = values.reshape(-1)
        scales = torch.empty(self.num_blocks(numel), dtype=torch.float32, device=values.device)
        values_nbytes = self._values_nbytes(numel)
        if self.kind == "int4":
            # Levels first, packed below; the ones past the values are zeros.
            levels = torch.zeros(2 * values_nbytes, dtype=torch.int8, device=values.device)
            narrow = levels[:numel]
        else:
            narrow = out[:numel].view(_WIRE_DTYPE[self.kind])
        largest, rounded = _LARGEST[self.kind], self.kind in _ROUNDED
        for begin, end, rows in self._spans(numel):
            blocks = _blocks(begin, self.block_numel, rows)
            codec_kernels.run(
                codec_kernels.encode_blocks,
                x[begin:end].view(rows, -1),
                narrow[begin:end].view(rows, -1),
                scales[blocks],
                largest,
                rounded,
            )
        if self.kind == "int4":
            pack_int4(levels, out[:values_nbytes])
        else:
            out[numel:values_nbytes].zero_()  # the padding: a record is a function of its values
        self._scales(out.view(1, -1), numel)[0].copy_(scales)
        return out

    def decode(self, records: torch.Tensor, out: torch.Tensor) -> None:
        """Fill `out` (R rows of n values, any float dtype) from `records` (R rows of
        `record_nbytes(n)` bytes): row r of `out` from record r."""
        self._each_block_span(records, out, codec_kernels.decode_blocks)

    def add_decoded(self, records: torch.Tensor, total: torch.Tensor) -> None:
        """Add to `total` (n values, fp32) each of `records` (R rows of `record_nbytes(n)`
        bytes) decoded, in row order: each decoded value rounded to fp32 as `decode` gives
        it, then the sum."""
        assert total.dtype == torch.float32, total.dtype
        for row in range(records.shape[0]):
            self._each_block_span(
                records[row : row + 1], total.view(1, -1), codec_kernels.add_decoded_blocks
            )

    def _each_block_span(
        self, records: torch.Tensor, out: torch.Tensor, kernel: Callable[..., None]
    ) -> None:
        """Run `kernel(narrow, scales, target)` over the whole blocks and the shorter last one
        of each record and its row of `out` (R rows of n values)."""
        rows_out, numel = out.shape
        assert records.dtype == torch.uint8, records.dtype
        assert records.shape == (rows_out, self.record_nbytes(numel)), records.shape
        if self.kind == "int4":
            narrow = unpack_int4(records[:, : self._values_nbytes(numel)])[:, :numel]
        else:
            narrow = records[:, :numel].view(_WIRE_DTYPE[self.kind])
        scales = self._scales(records, numel)
        for row in range(rows_out):
            for begin, end, rows in self._spans(numel):
                codec_kernels.run(
                    kernel,
                    narrow[row, begin:end].view(rows, -1),
                    scales[row, _blocks(begin, self.block_numel, rows)],
                    out[row, begin:end].view(rows, -1),
                )

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

    def _values_nbytes(self, numel: int) -> int:
        """Bytes of a record's values, padded to 4 (int4 packs two a byte)."""
        nbytes = -(-numel // 2) if self.kind == "int4" else numel
        return -(-nbytes // 4) * 4

    def _scales(self, records: torch.Tensor, numel: int) -> torch.Tensor:
        begin = self._values_nbytes(numel)
        return records[:, begin : begin + 4 * self.num_blocks(numel)].view(torch.float32)


def pack_int4(levels: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Pack the flat int8 `levels` (each in [-8, 7], an even count) two to a byte into `out`
    (uint8, half as many) and return it: level i in the low half of byte i // 2 when i is even,
    the high half when odd, as level + 8 (see [Note: int4 packing])."""
    assert levels.dtype == torch.int8 and levels.numel() == 2 * out.numel(), levels.shape
    codes = (levels + _INT4_ZERO).view(torch.uint8)
    return torch.bitwise_or(codes[0::2], codes[1::2] << 4, out=out)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The levels `pack_int4` packed into `packed` (uint8, any rows): int8, twice as many per
    row, exactly as they were."""
    assert packed.dtype == torch.uint8, packed.dtype
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)
    return codes.view(torch.int8).sub_(_INT4_ZERO)


def _blocks(begin: int, block_numel: int, rows: int) -> slice:
    """The blocks (scales) of `rows` blocks starting at value `begin`."""
    first = begin // block_numel
    return slice(first, first + rows)
