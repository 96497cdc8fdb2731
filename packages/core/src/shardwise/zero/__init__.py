"""The ColossalAI-named API (`colossalai.zero`'s paths with `shardwise` for `colossalai`): each
name translates its arguments into one `EngineConfig` and builds the engine (shardwise/engine)."""

from shardwise.engine import (
    Chunking,
    Communication,
    EngineConfig,
    MixedPrecision,
    Overlap,
    Placement,
    Reduction,
    Topology,
    ZeroModel,
    ZeroOptimizer,
)
from shardwise.zero.gemini import GeminiAdamOptimizer, GeminiOptimizer
from shardwise.zero.gemini_ddp import GeminiDDP, ZeroDDP
from shardwise.zero.init_context import ZeroInitContext
from shardwise.zero.low_level import LowLevelZeroOptimizer
from shardwise.zero.shard_strategy import (
    BaseShardStrategy,
    BucketTensorShardStrategy,
    TensorShardStrategy,
)
from shardwise.zero.sharded_v2 import ShardedModelV2, ShardedOptimizerV2
from shardwise.zero.wrappers import zero_model_wrapper, zero_optim_wrapper

__all__ = [
    "Chunking",
    "Communication",
    "EngineConfig",
    "Overlap",
    "Placement",
    "Reduction",
    "Topology",
    "BaseShardStrategy",
    "BucketTensorShardStrategy",
    "GeminiAdamOptimizer",
    "GeminiDDP",
    "GeminiOptimizer",
    "LowLevelZeroOptimizer",
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
