"""shardwise: chunk-based ZeRO (stages 1-3) for PyTorch.

The public names below are configurations of one chunk engine: parameters live in flat chunks
sharded over the data-parallel ranks, gradients are reduced per chunk, and a sharded fp32
master copy is stepped by any elementwise torch optimizer.
"""

import importlib.metadata

from shardwise import checkpoint, telemetry
from shardwise.amp import ConstantGradScaler, DynamicGradScaler, GradScaler
from shardwise.chunk import ChunkManager
from shardwise.comm import CommOp, CommStats
from shardwise.engine.wrap import wrap_model, wrap_optimizer
from shardwise.gemini import GeminiManager
from shardwise.host_memory import prefer_huge_pages
from shardwise.initialize import launch, launch_from_torch
from shardwise.optim import CPUAdam, HybridAdam
from shardwise.zero import (
    BucketTensorShardStrategy,
    Chunking,
    Communication,
    EngineConfig,
    GeminiDDP,
    MixedPrecision,
    Overlap,
    Placement,
    Reduction,
    ShardedModelV2,
    ShardedOptimizerV2,
    TensorShardStrategy,
    Topology,
    ZeroDDP,
    ZeroInitContext,
    ZeroModel,
    ZeroOptimizer,
    zero_model_wrapper,
    zero_optim_wrapper,
)
from shardwise.zero.colo_ddp import ColoDDP

# The installed distribution's version: packages/core/pyproject.toml holds the one number.
try:
    __version__ = importlib.metadata.version("shardwise")
except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

__all__ = [
    "BucketTensorShardStrategy",
    "ChunkManager",
    "Chunking",
    "Communication",
    "CPUAdam",
    "ColoDDP",
    "CommOp",
    "CommStats",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "EngineConfig",
    "GeminiDDP",
    "GeminiManager",
    "GradScaler",
    "HybridAdam",
    "MixedPrecision",
    "Overlap",
    "Placement",
    "Reduction",
    "ShardedModelV2",
    "ShardedOptimizerV2",
    "TensorShardStrategy",
    "Topology",
    "ZeroDDP",
    "ZeroInitContext",
    "ZeroModel",
    "ZeroOptimizer",
    "checkpoint",
    "launch",
    "launch_from_torch",
    "prefer_huge_pages",
    "telemetry",
    "wrap_model",
    "wrap_optimizer",
    "zero_model_wrapper",
    "zero_optim_wrapper",
]
