"""`colossalai.cluster`'s path: the coordinator of the ranks."""

from shardwise.cluster.dist_coordinator import DistCoordinator

__all__ = ["DistCoordinator"]
