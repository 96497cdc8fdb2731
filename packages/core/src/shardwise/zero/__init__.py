"""ZeRO stages 1-3 over the chunk engine: the wrapped model, its optimizer, the seed wrappers."""

from shardwise.zero.config import MixedPrecision, ZeroConfig
from shardwise.zero.gemini_ddp import GeminiDDP, ZeroDDP
from shardwise.zero.model import ZeroModel
from shardwise.zero.optimizer import ZeroOptimizer
from shardwise.zero.wrappers import zero_model_wrapper, zero_optim_wrapper

__all__ = [
    "GeminiDDP",
    "MixedPrecision",
    "ZeroConfig",
    "ZeroDDP",
    "ZeroModel",
    "ZeroOptimizer",
    "zero_model_wrapper",
    "zero_optim_wrapper",
]
