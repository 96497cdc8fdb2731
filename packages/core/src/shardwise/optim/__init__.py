"""Optimizers that step shards wherever they live."""

from shardwise.optim.hybrid_adam import CPUAdam, HybridAdam

__all__ = ["CPUAdam", "HybridAdam"]
