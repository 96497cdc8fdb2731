"""Chunks: flat, sharded buffers of parameters, and the manager that packs them."""

from shardwise.chunk.chunk import Chunk
from shardwise.chunk.manager import ChunkManager
from shardwise.chunk.states import (
    ChunkDtypes,
    ChunkState,
    GradLayout,
    GradState,
    Pool,
    TensorInfo,
    TensorState,
)

__all__ = [
    "Chunk",
    "ChunkDtypes",
    "ChunkManager",
    "ChunkState",
    "GradLayout",
    "GradState",
    "Pool",
    "TensorInfo",
    "TensorState",
]
