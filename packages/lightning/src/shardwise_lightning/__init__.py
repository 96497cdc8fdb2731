"""PyTorch Lightning strategies over the shardwise engine.

Importing this package registers the strategy names "shardwise_gemini",
"shardwise_gemini_offload", "shardwise_gemini_auto", "shardwise_fsdp" and
"shardwise_fsdp_offload" in Lightning's strategy registry: `pytorch_lightning`'s, and, where the
unified `lightning` package is installed, `lightning.pytorch`'s too, whose classes are imported
from `shardwise_lightning.unified` (see [Note: two Lightning namespaces] there).
"""

import importlib.metadata
import importlib.util

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

if importlib.util.find_spec("lightning") is not None:
    # The same names for lightning.Trainer (see [Note: two Lightning namespaces]).
    import shardwise_lightning.unified  # noqa: F401

__all__ = [
    "STRATEGY_NAMES",
    "FullyShardedStrategy",
    "GeminiStrategy",
    "ShardwisePrecision",
    "StreamingCheckpointIO",
    "register_strategies",
]
