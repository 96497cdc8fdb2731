"""The wire formats part of the engine's configuration (`EngineConfig.communication`), and the
one check every front door's wire settings go through."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.chunk.wire import WireFormats
from shardwise.comm import ReduceScatterMethod
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL, BlockQuantizer, check_wire_formats


@dataclass(frozen=True, kw_only=True, slots=True)
class Communication:
    """Wire formats: what parameters are gathered in and gradients reduced in (see [Note: wire
    formats] in chunk/wire/formats.py). Off ("dtype") both sides send what they always did, bit
    for bit."""

    gather: str = "dtype"
    """Parameter all-gathers: "dtype" (the payload dtype, `MixedPrecision.param_dtype`),
    "int8" or "fp8" (ZeRO++'s qwZ: one byte per value with an fp32 scale per block; each rank
    keeps its own slice and its fp32 masters exact, see [Note: quantized gathers] in
    chunk/wire/formats.py). Not "int4": see [Note: int4 is for gradients] in
    comm/quantize.py."""
    reduce: str = "dtype"
    """Gradient reduce-scatters: "dtype" (`MixedPrecision.reduce_dtype`, by the
    `gradient_reduction` method), "int8", "fp8" or "int4" (ZeRO++'s qgZ: an all-to-all of
    quantized slices, summed in fp32 by their owner, see [Note: quantized reductions] in
    chunk/wire/formats.py; int4 sends half a byte per value)."""
    block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL
    """Values per quantization block, each with one fp32 scale (4 / block_numel bytes per
    value on top of the value's one byte, or half byte for int4)."""

    def __post_init__(self) -> None:
        check_wire_formats(self.gather, self.reduce, self.block_numel)

    @property
    def quantizes(self) -> bool:
        """Whether either side sends quantized values."""
        return self.gather != "dtype" or self.reduce != "dtype"

    def wire_formats(self, reduce_method: ReduceScatterMethod) -> WireFormats:
        """The chunks' wire formats, unquantized reduce-scatters running by `reduce_method`."""
        return WireFormats(
            gather=self._quantizer(self.gather),
            reduce=self._quantizer(self.reduce),
            reduce_method=reduce_method,
        )

    def _quantizer(self, name: str) -> BlockQuantizer | None:
        return None if name == "dtype" else BlockQuantizer(name, self.block_numel)


def communication_settings(
    *,
    gather_format: object = "dtype",
    reduce_format: object = "dtype",
    quant_block_numel: object = DEFAULT_QUANT_BLOCK_NUMEL,
    fp8_communication: object = False,
    caller: str = "",
) -> Communication:
    """The wire formats as every front door names them, validated once: the `gemini_config`
    keys, the keyword arguments of the wrappers, plugins and adapters.

    ColossalAI's `fp8_communication=True` is both sides in fp8: `gather_format="fp8"` and
    `reduce_format="fp8"` (ColossalAI's plugins gather and reduce in fp8 under it); naming a
    format as well is refused, so one setting says what is sent.

    Args:
        gather_format: parameter all-gathers: "dtype", "int8" or "fp8" (see `Communication`).
        reduce_format: gradient reductions: "dtype", "int8" or "fp8".
        quant_block_numel: values per quantization block, each with one fp32 scale.
        fp8_communication: ColossalAI's flag (a bool): both formats "fp8".
        caller: the class or function named at the start of messages ("" for none).
    """
    prefix = f"{caller}: " if caller else ""
    if not isinstance(fp8_communication, bool):
        raise TypeError(f"{prefix}fp8_communication must be a bool, got {fp8_communication!r}")
    if fp8_communication:
        named = {
            key: value
            for key, value in (("gather_format", gather_format), ("reduce_format", reduce_format))
            if value != "dtype"
        }
        if named:
            given = ", ".join(f"{key}={value!r}" for key, value in named.items())
            raise ValueError(
                f"{prefix}fp8_communication=True means gather_format='fp8' and "
                f"reduce_format='fp8'; it cannot be combined with {given}: leave "
                f"fp8_communication=False and set both formats, or drop {', '.join(named)}"
            )
        gather_format = reduce_format = "fp8"
    try:
        return Communication(
            gather=gather_format,  # type: ignore[arg-type]  # checked by Communication
            reduce=reduce_format,  # type: ignore[arg-type]
            block_numel=quant_block_numel,  # type: ignore[arg-type]
        )
    except (TypeError, ValueError) as error:
        if not prefix:
            raise
        raise type(error)(f"{prefix}{error}") from None
