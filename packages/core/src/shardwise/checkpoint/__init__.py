"""Sharded, world-size independent, atomic and verified checkpoints."""

from shardwise.checkpoint.api import load, save
from shardwise.checkpoint.commit import CheckpointError
from shardwise.checkpoint.hf_format import export_hf, load_hf

__all__ = ["CheckpointError", "export_hf", "load", "load_hf", "save"]
