"""The engine: one `EngineConfig` and the model and optimizer built from it.

Layers, each importing only those below it (see [Note: one configuration] in
zero/front_door.py for how the seed API reaches this one):

    zero/      the ColossalAI-named front doors: they translate their arguments into an
               EngineConfig and call the build here; nothing below imports them
    engine/    EngineConfig, the wrapped model (`ZeroModel`), the master-weight optimizer
               (`ZeroOptimizer`), state dicts, the gradient norm, the build
    runtime/   what runs during a pass: gathers and their schedule, gather units, gradient
               reduction, deferred parameter gathers, the ranks' agreement checks
    prepare/   a module's parameters before they are packed: ignored ones, meta-device
               construction, slices from a ZeroInitContext
    chunk/, gemini/, comm/, amp/, optim/: buffers, placement, collectives, loss scale, Adam
"""

from shardwise.engine.communication import Communication
from shardwise.engine.config import (
    Chunking,
    EngineConfig,
    MixedPrecision,
    Overlap,
    Placement,
    Reduction,
    Topology,
)
from shardwise.engine.model import ZeroModel
from shardwise.engine.optimizer import ZeroOptimizer, optimizer_of

__all__ = [
    "Chunking",
    "Communication",
    "EngineConfig",
    "MixedPrecision",
    "Overlap",
    "Placement",
    "Reduction",
    "Topology",
    "ZeroModel",
    "ZeroOptimizer",
    "optimizer_of",
]
