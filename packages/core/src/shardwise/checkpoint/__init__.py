"""Sharded, world-size independent, atomic and verified checkpoints."""

from shardwise.checkpoint.api import load, save
from shardwise.checkpoint.commit import CheckpointError

__all__ = ["CheckpointError", "load", "save"]
