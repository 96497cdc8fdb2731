"""Blockwise int8, fp8 and int4 quantization (comm/quantize.py): each format's round-trip
error against its bound, on edge values: zeros, inf and nan (an fp16 overflow under loss
scaling), blocks that straddle parameters of different magnitudes, a last block shorter than
the others, odd lengths, 16-bit inputs and a tensor's zero padding; int4's packing of two
values a byte, exactly.

The bounds are [Note: blockwise quantization]'s: int8 within absmax / 254 of each value (half
a step of a block's 255 levels), int4 within absmax / 14 (half a step of its 15 levels, -7 to
7), fp8 e4m3 within 2^-4 of the value where it is in e4m3's normal range and 2^-10 of the
block's scale below it; all plus fp32's rounding of the division and the product (a few units
in the last place of the block's absmax, allowed as 1e-6 of it).
"""

from __future__ import annotations

import pytest
import torch
from helpers import FP32_SLACK, HALF_STEP, round_trip_bound

from shardwise.comm.quantize import BlockQuantizer, fp8_casts_work, pack_int4, unpack_int4

KINDS = ("int8", "fp8", "int4")


def _values(numel: int, seed: int = 0) -> torch.Tensor:
    """Values over nine decades, signs mixed, so blocks hold very different magnitudes."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = torch.logspace(-4, 4, numel)[torch.randperm(numel, generator=generator)]
    return torch.randn(numel, generator=generator) * magnitude


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", [1, 7, 64, 256])
def test_round_trip_stays_within_the_bound(kind: str, block: int) -> None:
    quantizer = BlockQuantizer(kind, block)
    x = _values(1000)  # 1000 is no multiple of 7, 64 or 256: a shorter last block
    decoded = quantizer.round_trip(x)
    error = (decoded - x).abs()
    assert bool((error <= round_trip_bound(kind, x, block)).all()), float(
        (error / round_trip_bound(kind, x, block)).max()
    )
    # Not a copy: most values moved (a format that sent fp32 would pass the bound too);
    # blocks of one value are their own absmax, a level of the format.
    assert int((decoded != x).sum()) > (500 if block > 1 else 0)
    # The largest value of each block is a level of its own: exact for int8 (127 * scale) and
    # int4 (7 * scale).
    if kind in HALF_STEP and block == 7:
        blocks = x[:994].view(-1, 7)
        largest = blocks.abs().argmax(dim=1) + torch.arange(0, 994, 7)
        assert torch.allclose(decoded[largest], x[largest], rtol=FP32_SLACK * 4, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_the_bound_is_tight_enough_to_fail(kind: str) -> None:
    """The check above can fail: halve the bound and values break it."""
    quantizer = BlockQuantizer(kind, 64)
    x = _values(1000, seed=1)
    error = (quantizer.round_trip(x) - x).abs()
    assert bool((error > round_trip_bound(kind, x, 64) / 2).any())


@pytest.mark.parametrize("kind", KINDS)
def test_zeros_decode_to_zeros_exactly(kind: str) -> None:
    quantizer = BlockQuantizer(kind, 4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.5, 0.0, -2.0, 0.0, 0.0, 0.0])
    decoded = quantizer.round_trip(x)
    assert torch.equal(decoded[:4], torch.zeros(4))  # a block of zeros: scale 0, no 0 / 0
    assert torch.equal(decoded[x == 0], torch.zeros(int((x == 0).sum())))
    assert torch.equal(quantizer.round_trip(torch.zeros(9)), torch.zeros(9))
    assert torch.equal(quantizer.round_trip(-torch.zeros(3)).abs(), torch.zeros(3))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_value_makes_its_whole_block_nan_and_no_other(kind: str, bad: float) -> None:
    """An fp16 gradient that overflowed under loss scaling must not decode finite: the rank
    that sums it finds the overflow in its step's norm. fp8 has no inf and torch's CPU cast
    saturates inf to 448, so the format itself must carry it."""
    quantizer = BlockQuantizer(kind, 4)
    x = torch.tensor([1.0, -3.0, 2.0, 0.5, 7.0, bad, 0.0, 1.0, 4.0, 5.0], dtype=torch.float16)
    decoded = quantizer.round_trip(x)
    assert bool(decoded[4:8].isnan().all())
    assert bool(decoded[:4].isfinite().all()) and bool(decoded[8:].isfinite().all())
    finite = torch.cat([x[:4], x[8:]]).float()
    error = (torch.cat([decoded[:4], decoded[8:]]) - finite).abs()
    assert bool(
        (
            error
            <= torch.cat(
                [round_trip_bound(kind, x[:4].float(), 4), round_trip_bound(kind, x[8:].float(), 4)]
            )
        ).all()
    )


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_extremes_round_trip_within_the_bound(kind: str) -> None:
    """A loss-scaled fp16 gradient near the top of fp16's range, and tiny ones, keep their
    bound (scales are fp32, so neither end overflows or flushes)."""
    quantizer = BlockQuantizer(kind, 4)
    x = torch.tensor([65504.0, -60000.0, 1.0, 3e-5, 6e-8, -6e-8, 1e-7, 0.0], dtype=torch.float16)
    decoded = quantizer.round_trip(x)
    assert bool(decoded.isfinite().all())
    assert bool(((decoded - x.float()).abs() <= round_trip_bound(kind, x.float(), 4)).all())
    tiny = torch.tensor([1e-30, -3e-31, 2e-32, 0.0])
    assert bool(
        ((quantizer.round_trip(tiny) - tiny).abs() <= round_trip_bound(kind, tiny, 4)).all()
    )


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_straddling_two_parameters(kind: str) -> None:
    """A small parameter packed after a large one: the block they share is scaled by the large
    one's values (within the bound of that block, so the small values there may round to
    zero), while the small parameter's own blocks keep its precision."""
    quantizer = BlockQuantizer(kind, 8)
    large = torch.linspace(-1000.0, 1000.0, 13)
    small = torch.linspace(-1e-3, 1e-3, 19)
    flat = torch.cat([large, small])  # elements 13-15 share block 1 with the large tensor
    decoded = quantizer.round_trip(flat)
    assert bool(((decoded - flat).abs() <= round_trip_bound(kind, flat, 8)).all())
    own_blocks = slice(16, 32)  # blocks 2 and 3: small values only
    relative = (decoded[own_blocks] - flat[own_blocks]).abs().max() / small.abs().max()
    assert float(relative) <= HALF_STEP.get(kind, 2.0**-4) + FP32_SLACK
    shared = (decoded[13:16] - flat[13:16]).abs().max()
    assert float(shared) > float(small.abs().max()) / 2 or kind == "fp8"


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_sum_stays_within_its_contributions_bounds(kind: str) -> None:
    """What the owner of a slice computes in a quantized reduction (see [Note: quantized
    reductions] in chunk/wire/formats.py): its own contribution as it is plus the other
    ranks' records decoded, added in fp32 in rank order. Against the exact sum (fp64) it is
    off by at most the sum of the others' round-trip bounds and fp32's rounding of the
    additions; the rounding happens once per contribution, never on a partial sum. Halving
    the bound fails, so the check can."""
    quantizer = BlockQuantizer(kind, 64)
    world, me, numel = 4, 1, 1000
    contributions = [_values(numel, seed=10 + rank) for rank in range(world)]
    records = torch.stack(
        [
            quantizer.encode(x, torch.empty(quantizer.record_nbytes(numel), dtype=torch.uint8))
            for rank, x in enumerate(contributions)
            if rank != me
        ]
    )
    decoded = torch.empty(world - 1, numel)
    quantizer.decode(records, decoded)
    reduced = contributions[me].clone()
    for row in decoded:
        reduced.add_(row)
    exact = sum(x.double() for x in contributions)
    error = (reduced.double() - exact).abs()
    bound = sum(round_trip_bound(kind, x, 64) for r, x in enumerate(contributions) if r != me)
    additions = (world - 1) * 2.0**-24 * sum(x.double().abs() for x in contributions)
    assert bool((error <= bound.double() + additions).all())
    assert bool((error > bound.double() / 2).any())


@pytest.mark.parametrize("kind", KINDS)
def test_zero_padding_changes_no_value(kind: str) -> None:
    """A chunk is padded with zeros to a multiple of the ranks; they fall in the last rank's
    last block and leave every value's scale as it was."""
    quantizer = BlockQuantizer(kind, 4)
    x = _values(10, seed=2)
    padded = torch.cat([x, torch.zeros(2)])
    assert torch.equal(quantizer.round_trip(padded)[:10], quantizer.round_trip(x))
    assert torch.equal(quantizer.round_trip(padded)[10:], torch.zeros(2))


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_records_decode_into_16_bit_buffers_and_rows(kind: str) -> None:
    """Several records decode at once, row by row, into any float dtype (a bf16 compute
    buffer): one rounding of the product in that dtype on top of the bound."""
    quantizer = BlockQuantizer(kind, 5)
    rows = [_values(12, seed=s) for s in range(3)]
    records = torch.stack(
        [
            quantizer.encode(r, torch.empty(quantizer.record_nbytes(12), dtype=torch.uint8))
            for r in rows
        ]
    )
    out = torch.empty(3, 12, dtype=torch.bfloat16)
    quantizer.decode(records, out)
    for row, values in zip(out, rows, strict=True):
        exact = quantizer.round_trip(values)
        assert torch.equal(row, exact.to(torch.bfloat16))


def test_record_layout_and_sizes() -> None:
    int8 = BlockQuantizer("int8", 256)
    # 1000 values padded to 1000 bytes (a multiple of 4), then 4 fp32 scales.
    assert int8.num_blocks(1000) == 4
    assert int8.record_nbytes(1000) == 1000 + 16
    assert int8.record_nbytes(1001) == 1004 + 16
    record = int8.encode(
        torch.full((300,), 2.54), torch.empty(int8.record_nbytes(300), dtype=torch.uint8)
    )
    assert torch.equal(record[:300].view(torch.int8), torch.full((300,), 127, dtype=torch.int8))
    scales = record[300:308].view(torch.float32)
    assert torch.allclose(scales, torch.full((2,), 2.54 / 127))
    # Against fp32 on the wire: a quarter, plus the scales.
    assert int8.record_nbytes(4096) / (4096 * 4) == pytest.approx((1 + 4 / 256) / 4)


def test_int4_record_layout_and_sizes() -> None:
    """Two values a byte (value i in the low half of byte i // 2 when i is even, the high half
    when odd, as level + 8), padded to 4 bytes with zero levels, then the fp32 scales."""
    int4 = BlockQuantizer("int4", 256)
    assert int4.record_nbytes(1000) == 500 + 16
    assert int4.record_nbytes(1001) == 504 + 16  # 501 bytes of values, padded to 504
    assert int4.record_nbytes(1) == 4 + 4
    # Against int8: half the values' bytes, the same scales.
    int8 = BlockQuantizer("int8", 256)
    assert int4.record_nbytes(4096) == 4096 // 2 + 64 == int8.record_nbytes(4096) - 4096 // 2
    assert int4.record_nbytes(4096) / (4096 * 4) == pytest.approx((0.5 + 4 / 256) / 4)
    # Levels 1, -7, 7, 0, 7 of one block with scale 1: bytes 0x19 (1 + 8, then -7 + 8 in the
    # high half), 0x8f, 0x0f's low half with a zero (8) above it, then zero padding.
    values = torch.tensor([1.0, -7.0, 7.0, 0.0, 7.0])
    record = int4.encode(values, torch.empty(int4.record_nbytes(5), dtype=torch.uint8))
    assert record[:4].tolist() == [0x19, 0x8F, 0x8F, 0x88]
    assert record[4:8].view(torch.float32).tolist() == [1.0]
    assert torch.equal(int4.round_trip(values), values)


def test_int4_packing_is_exact() -> None:
    """Every level -8 to 7 in either half of a byte unpacks as it was; an odd count's last
    high half and the padding are zero levels."""
    levels = torch.arange(-8, 8, dtype=torch.int8)
    pairs = torch.cartesian_prod(levels, levels).reshape(-1)  # each level beside each other
    packed = pack_int4(pairs, torch.empty(pairs.numel() // 2, dtype=torch.uint8))
    assert torch.equal(unpack_int4(packed), pairs)
    assert torch.equal(unpack_int4(packed.view(16, -1)), pairs.view(16, -1))  # rows alike
    assert len(set(packed.tolist())) == 256  # every byte used once: nothing is lost
    int4 = BlockQuantizer("int4", 3)
    for numel in (1, 2, 3, 7, 8, 9, 31):
        record = int4.encode(
            _values(numel, seed=numel), torch.empty(int4.record_nbytes(numel), dtype=torch.uint8)
        )
        values_nbytes = record.numel() - 4 * int4.num_blocks(numel)
        unpacked = unpack_int4(record[:values_nbytes])
        assert bool((unpacked[:numel].abs() <= 7).all())  # -8 is never sent
        assert bool((unpacked[numel:] == 0).all()), numel


@pytest.mark.parametrize("block", [3, 7, 256])
@pytest.mark.parametrize("numel", [1, 2, 3, 13, 257, 1001])
def test_int4_blocks_starting_mid_byte_decode_as_on_their_own(block: int, numel: int) -> None:
    """The packing runs over the record whatever the blocks: a block of odd length puts the
    next one's first value in a high half, and each block still decodes exactly as it does
    quantized alone (its own scale, its own levels)."""
    int4 = BlockQuantizer("int4", block)
    x = _values(numel, seed=numel + block)
    decoded = int4.round_trip(x)
    for begin in range(0, numel, block):
        alone = int4.round_trip(x[begin : begin + block])
        assert torch.equal(decoded[begin : begin + block], alone), begin
    assert bool(((decoded - x).abs() <= round_trip_bound("int4", x, block)).all())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs_round_trip_within_the_bound(kind: str, dtype: torch.dtype) -> None:
    """Gradients reduced in a 16-bit reduce dtype: the bound holds against the 16-bit values
    themselves (they are exact in fp32), odd lengths and a shorter last block included."""
    quantizer = BlockQuantizer(kind, 64)
    for numel in (1, 63, 1001):
        x = (_values(numel, seed=numel) / 10).to(dtype)  # within fp16's range
        decoded = quantizer.round_trip(x)
        assert decoded.dtype == torch.float32
        bound = round_trip_bound(kind, x.float(), 64)
        assert bool(((decoded - x.float()).abs() <= bound).all()), numel
        assert torch.equal(decoded, quantizer.round_trip(x.float()))


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="one of"):
        BlockQuantizer("int2", 64)
    with pytest.raises(ValueError, match="quant_block_numel must be a positive int, got 0"):
        BlockQuantizer("int8", 0)


def test_fp8_casts_work_on_this_cpu() -> None:
    """torch 2.13's CPU build converts to and from float8_e4m3fn, so the fp8 format is
    offered here; a device without the casts is refused (see test_wire_formats)."""
    assert fp8_casts_work(torch.device("cpu"))
    x = torch.tensor([448.0, -1.75, 2.0**-9, 0.0])
    assert torch.equal(x.to(torch.float8_e4m3fn).float(), x)
