"""`colossalai.interface`'s path: the wrappers a boosted model and optimizer are seen through."""

from shardwise.interface.model import ModelWrapper
from shardwise.interface.optimizer import OptimizerWrapper

__all__ = ["ModelWrapper", "OptimizerWrapper"]
