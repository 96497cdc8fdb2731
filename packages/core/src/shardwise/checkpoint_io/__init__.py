"""`colossalai.checkpoint_io`'s path: the interface every plugin's checkpoint IO implements, and
`GeneralCheckpointIO` for plain torch models (one process or DDP replicas)."""

from shardwise.checkpoint_io.checkpoint_io_base import CheckpointIO
from shardwise.checkpoint_io.general_checkpoint_io import GeneralCheckpointIO

__all__ = ["CheckpointIO", "GeneralCheckpointIO"]
