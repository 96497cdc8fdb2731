"""Registration of the shardwise strategies in Lightning's strategy registry.

Lightning registers only the strategies it ships, so `import shardwise_lightning` does it for
ours; afterwards `Trainer(strategy="shardwise_gemini")` and the other names work.
"""

from __future__ import annotations

from pytorch_lightning.strategies import StrategyRegistry

from shardwise_lightning.fully_sharded import FullyShardedStrategy
from shardwise_lightning.gemini import GeminiStrategy


def register_strategies() -> list[str]:
    """Register every shardwise strategy name (a repeated call replaces the entries) and
    return the names."""
    for cls in (GeminiStrategy, FullyShardedStrategy):
        cls.register_strategies(StrategyRegistry)
    return sorted(name for name in StrategyRegistry if name.startswith("shardwise_"))
