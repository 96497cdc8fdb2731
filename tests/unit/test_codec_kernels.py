"""The wire codec's compiled kernels (comm/codec_kernels.py) give the eager functions' bits on
the CPU ([Note: compiled codecs]): every format's records, decoding into each float dtype and
the fp32 sum of decoded records, on edge values (halfway cases of the rounding, zeros, inf and
nan blocks, subnormals, 16-bit inputs), through `BlockQuantizer` as the
engine calls it; and a failed compile falls back to eager with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from torch._inductor import config as inductor_config

from shardwise.comm import codec_kernels
from shardwise.comm.quantize import BlockQuantizer

BLOCK = 64


def _edge_values(numel: int) -> torch.Tensor:
    """Values over many decades, with blocks made to hit every edge case."""
    generator = torch.Generator().manual_seed(0)
    magnitude = torch.logspace(-6, 6, numel)[torch.randperm(numel, generator=generator)]
    x = torch.randn(numel, generator=generator) * magnitude
    blocks = x[: numel // BLOCK * BLOCK].view(-1, BLOCK)
    # Halfway cases: absmax 127 (int8's scale exactly 1) and 448 (fp8's), values k + 1/2.
    blocks[0] = torch.arange(BLOCK) - 31.5
    blocks[0, 0] = 127.0
    blocks[1] = torch.arange(BLOCK) * 7 + 0.5
    blocks[1, 0] = 448.0
    blocks[2] = 0.0  # a zero block: scale 0, decoded exactly
    blocks[3, 5] = float("inf")
    blocks[4, 9] = float("-inf")
    blocks[5, 1] = float("nan")
    blocks[6] = torch.randn(BLOCK, generator=generator) * 1e-39  # fp32 subnormals
    return x


@pytest.fixture
def compiled_everywhere(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every call over whole blocks runs compiled; a short last block runs eagerly, as in the
    engine, where it is below the threshold (a block count of one would be graphs of its own
    to compile). Inductor compiles in this process, with no pool of compile workers:
    multi-rank tests fork their ranks from it, and a forked rank must not inherit a pool
    (tests/conftest.py)."""
    monkeypatch.setattr(codec_kernels, "COMPILE_MIN_NUMEL", 2 * BLOCK)
    with inductor_config.patch(compile_threads=1):
        yield


def _bits(values: torch.Tensor) -> torch.Tensor:
    """`values`' bits as integers (nan compares equal to the same nan)."""
    return values.view(torch.int32 if values.element_size() == 4 else torch.int16)


def _records(kind: str, values: torch.Tensor) -> torch.Tensor:
    quantizer = BlockQuantizer(kind, BLOCK)
    record = torch.empty(quantizer.record_nbytes(values.numel()), dtype=torch.uint8)
    return quantizer.encode(values, record)


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
def test_compiled_records_and_decoding_are_the_eager_bits(
    kind: str, compiled_everywhere: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    numel = 40 * BLOCK + 17  # a shorter last block
    x = _edge_values(numel)
    quantizer = BlockQuantizer(kind, BLOCK)
    compiled = _records(kind, x)
    assert codec_kernels.encode_blocks in codec_kernels._compiled  # the compiled path ran
    # Each output dtype is a kernel of its own: the 16-bit ones once, with int8.
    sixteen_bit = (torch.bfloat16, torch.float16) if kind == "int8" else ()
    decoded = {dtype: torch.empty(1, numel, dtype=dtype) for dtype in (torch.float32, *sixteen_bit)}
    for out in decoded.values():
        quantizer.decode(compiled.view(1, -1), out)
    total = torch.randn(numel)
    total_compiled = total.clone()
    quantizer.add_decoded(torch.stack([compiled, compiled]), total_compiled)

    monkeypatch.setattr(codec_kernels, "COMPILE_MIN_NUMEL", numel + 1)  # eager from here
    eager = _records(kind, x)
    assert torch.equal(compiled, eager)
    for dtype, out in decoded.items():
        expected = torch.empty(1, numel, dtype=dtype)
        quantizer.decode(eager.view(1, -1), expected)
        assert torch.equal(_bits(out), _bits(expected))
    quantizer.add_decoded(torch.stack([eager, eager]), total)
    assert torch.equal(_bits(total_compiled), _bits(total))
    # The edge blocks decoded as the format says: zeros exactly, non-finite blocks all nan.
    back = decoded[torch.float32][0]
    assert bool((back[2 * BLOCK : 3 * BLOCK] == 0).all())
    assert bool(back[3 * BLOCK : 6 * BLOCK].isnan().all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_encoding_of_16_bit_values_is_the_eager_bits(
    dtype: torch.dtype, compiled_everywhere: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = (_edge_values(20 * BLOCK)[7 * BLOCK :]).clamp(-6e4, 6e4).to(dtype)
    compiled = _records("int8", x)
    monkeypatch.setattr(codec_kernels, "COMPILE_MIN_NUMEL", x.numel() + 1)
    assert torch.equal(compiled, _records("int8", x))


def test_small_tensors_run_eagerly_and_large_ones_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(codec_kernels, "_compiled", {})

    def fake_compile(kernel: object, **options: object) -> object:
        def compiled(*args: object) -> None:
            calls.append("compiled")
            kernel(*args)  # type: ignore[operator]

        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(codec_kernels, "COMPILE_MIN_NUMEL", 4 * BLOCK)
    _records("int8", torch.randn(3 * BLOCK))
    assert calls == []
    _records("int8", torch.randn(4 * BLOCK))
    assert calls == ["compiled"]


def test_a_failed_compile_warns_once_and_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec_kernels, "_compiled", {})
    monkeypatch.setattr(codec_kernels, "_eager_only", set())

    def failing_compile(kernel: object, **options: object) -> object:
        def compiled(*args: object) -> None:
            raise RuntimeError("no C++ compiler")

        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    monkeypatch.setattr(codec_kernels, "COMPILE_MIN_NUMEL", 0)
    x = _edge_values(8 * BLOCK)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler.*runs eagerly"):
        first = _records("int8", x)
    monkeypatch.setattr(codec_kernels, "COMPILE_MIN_NUMEL", x.numel() + 1)
    assert torch.equal(first, _records("int8", x))
    monkeypatch.setattr(codec_kernels, "COMPILE_MIN_NUMEL", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert torch.equal(first, _records("int8", x))
