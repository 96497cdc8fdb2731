"""Sharded, world-size independent, atomic and verified checkpoints."""

from shardwise.checkpoint.api import load, save, sharded_state_dict
from shardwise.checkpoint.commit import CheckpointError
from shardwise.checkpoint.hf_format import export_hf, load_hf
from shardwise.checkpoint.zero_optimizer_io import gather_optimizer_state, load_optimizer_state

__all__ = [
    "CheckpointError",
    "export_hf",
    "gather_optimizer_state",
    "load",
    "load_hf",
    "load_optimizer_state",
    "save",
    "sharded_state_dict",
]
