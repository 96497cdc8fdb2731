"""`colossalai.cluster`'s path: the coordinator of the ranks and the mesh of process groups."""

from shardwise.cluster.dist_coordinator import DistCoordinator
from shardwise.cluster.process_group_mesh import ProcessGroupMesh

__all__ = ["DistCoordinator", "ProcessGroupMesh"]
