"""What the Booster's save_* / load_* methods go through, one per kind of boosted model."""

from shardwise.booster.checkpoint_io.checkpoint_io_base import CheckpointIO
from shardwise.booster.checkpoint_io.torch_checkpoint_io import TorchCheckpointIO
from shardwise.booster.checkpoint_io.zero_checkpoint_io import ZeroCheckpointIO

__all__ = ["CheckpointIO", "TorchCheckpointIO", "ZeroCheckpointIO"]
