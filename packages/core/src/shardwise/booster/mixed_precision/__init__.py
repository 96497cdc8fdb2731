"""`colossalai.booster.mixed_precision`'s path: the precisions `Booster(mixed_precision=...)`
applies to a plugin that leaves precision to it (TorchDDPPlugin)."""

from shardwise.booster.mixed_precision.autocast_module import TorchAMPModule
from shardwise.booster.mixed_precision.bf16 import BF16MixedPrecision
from shardwise.booster.mixed_precision.fp16_torch import FP16TorchMixedPrecision, TorchAMPOptimizer
from shardwise.booster.mixed_precision.mixed_precision_base import MixedPrecision

_BY_NAME: dict[str, type[MixedPrecision]] = {
    "fp16": FP16TorchMixedPrecision,
    "bf16": BF16MixedPrecision,
}


def mixed_precision_factory(mixed_precision_type: str) -> MixedPrecision:
    """The precision named `mixed_precision_type`: "fp16" (torch autocast and a gradient
    scaler) or "bf16" (torch autocast); ColossalAI's "fp16_apex", "fp16_naive" and "fp8" are
    refused.

    Args:
        mixed_precision_type: the name.
    """
    if mixed_precision_type not in _BY_NAME:
        raise ValueError(
            f"mixed_precision={mixed_precision_type!r} is not offered: use 'fp16' (torch "
            f"autocast with a gradient scaler) or 'bf16' (torch autocast); apex, the naive fp16 "
            f"and fp8 are not available"
        )
    return _BY_NAME[mixed_precision_type]()


__all__ = [
    "BF16MixedPrecision",
    "FP16TorchMixedPrecision",
    "MixedPrecision",
    "TorchAMPModule",
    "TorchAMPOptimizer",
    "mixed_precision_factory",
]
