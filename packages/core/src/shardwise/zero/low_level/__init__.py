"""`colossalai.zero.low_level`'s path: ZeRO stages 1 and 2 as an optimizer."""

from shardwise.zero.low_level.low_level_optim import LowLevelZeroOptimizer

__all__ = ["LowLevelZeroOptimizer"]
