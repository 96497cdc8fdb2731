"""`colossalai.booster`'s path: the Booster and its plugins, translating ColossalAI 0.5's
arguments into the engine's configuration."""

from shardwise.booster.booster import Booster

__all__ = ["Booster"]
