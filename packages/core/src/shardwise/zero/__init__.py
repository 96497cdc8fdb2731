"""ZeRO stages 1-3 over the chunk engine: the wrapped model, its optimizer, the seed wrappers."""

from shardwise.zero.config import (
    Chunking,
    EngineConfig,
    MixedPrecision,
    Overlap,
    Placement,
    Reduction,
    Topology,
)
from shardwise.zero.gemini_ddp import GeminiDDP, ZeroDDP
from shardwise.zero.init_context import ZeroInitContext
from shardwise.zero.model import ZeroModel
from shardwise.zero.optimizer import ZeroOptimizer
from shardwise.zero.shard_strategy import (
    BaseShardStrategy,
    BucketTensorShardStrategy,
    TensorShardStrategy,
)
from shardwise.zero.sharded_v2 import ShardedModelV2, ShardedOptimizerV2
from shardwise.zero.wrappers import zero_model_wrapper, zero_optim_wrapper

__all__ = [
    "Chunking",
    "EngineConfig",
    "Overlap",
    "Placement",
    "Reduction",
    "Topology",
    "BaseShardStrategy",
    "BucketTensorShardStrategy",
    "GeminiDDP",
    "MixedPrecision",
    "ShardedModelV2",
    "ShardedOptimizerV2",
    "TensorShardStrategy",
    "ZeroDDP",
    "ZeroInitContext",
    "ZeroModel",
    "ZeroOptimizer",
    "zero_model_wrapper",
    "zero_optim_wrapper",
]
