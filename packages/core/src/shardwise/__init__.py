"""shardwise: chunk-based ZeRO (stages 1-3) for PyTorch.

The public names below are configurations of one chunk engine: parameters live in flat chunks
sharded over the data-parallel ranks, gradients are reduced per chunk, and a sharded fp32
master copy is stepped by any elementwise torch optimizer.

[Note: a lazy top level]
`import shardwise` imports none of the engine: each public name is imported from its module
the first time it is used (`shardwise.zero_model_wrapper`, `from shardwise import HybridAdam`),
as is a subpackage reached as an attribute (`shardwise.booster`). The engine pulls in
torch.distributed.checkpoint, DTensor and torch._dynamo, which take seconds more than torch
itself; a script, a `shardwise --version` or an adapter's import pays for what it uses.
`tests/unit/test_import_time.py` holds `import shardwise` within half a second of
`import torch`. Type checkers read the imports under TYPE_CHECKING; `_SOURCES` says the same
for the interpreter, and the test checks that the two agree.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Public name -> the module it is imported from (a subpackage's own name: the subpackage).
_SOURCES = {
    "checkpoint": "shardwise.checkpoint",
    "telemetry": "shardwise.telemetry",
    **dict.fromkeys(("ConstantGradScaler", "DynamicGradScaler", "GradScaler"), "shardwise.amp"),
    "ChunkManager": "shardwise.chunk",
    **dict.fromkeys(("CommOp", "CommStats"), "shardwise.comm"),
    **dict.fromkeys(("wrap_model", "wrap_optimizer"), "shardwise.engine.wrap"),
    "GeminiManager": "shardwise.gemini",
    "prefer_huge_pages": "shardwise.host_memory",
    **dict.fromkeys(("launch", "launch_from_torch"), "shardwise.initialize"),
    **dict.fromkeys(("CPUAdam", "HybridAdam"), "shardwise.optim"),
    **dict.fromkeys(
        (
            "BucketTensorShardStrategy",
            "Chunking",
            "Communication",
            "EngineConfig",
            "GeminiDDP",
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
            "zero_model_wrapper",
            "zero_optim_wrapper",
        ),
        "shardwise.zero",
    ),
    "ColoDDP": "shardwise.zero.colo_ddp",
}


def __getattr__(name: str) -> Any:
    """A public name or a subpackage, imported where first used (see [Note: a lazy top
    level]) and kept, so the next use is an ordinary attribute."""
    source = _SOURCES.get(name)
    if source is not None:
        module = importlib.import_module(source)
        value = module if source == f"{__name__}.{name}" else getattr(module, name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
