"""PyTorch Lightning strategies over the shardwise engine.

Importing this package registers the strategy names "shardwise_gemini",
"shardwise_gemini_offload", "shardwise_gemini_auto", "shardwise_fsdp" and
"shardwise_fsdp_offload" in Lightning's strategy registry.
"""

import importlib.metadata

from shardwise_lightning.checkpoint_io import StreamingCheckpointIO
from shardwise_lightning.fully_sharded import FullyShardedStrategy
from shardwise_lightning.gemini import GeminiStrategy
from shardwise_lightning.precision import ShardwisePrecision
from shardwise_lightning.registry import register_strategies

# The installed distribution's version: packages/lightning/pyproject.toml holds the one number.
try:
    __version__ = importlib.metadata.version("shardwise-lightning")
except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

STRATEGY_NAMES = register_strategies()

__all__ = [
    "STRATEGY_NAMES",
    "FullyShardedStrategy",
    "GeminiStrategy",
    "ShardwisePrecision",
    "StreamingCheckpointIO",
    "register_strategies",
]
