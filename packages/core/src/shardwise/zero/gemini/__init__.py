"""`colossalai.zero.gemini`'s path: GeminiDDP, its optimizers and the chunk search."""

from shardwise.zero.gemini.chunk import search_chunk_configuration
from shardwise.zero.gemini.gemini_optimizer import GeminiAdamOptimizer, GeminiOptimizer
from shardwise.zero.gemini_ddp import GeminiDDP, ZeroDDP

__all__ = [
    "GeminiAdamOptimizer",
    "GeminiDDP",
    "GeminiOptimizer",
    "ZeroDDP",
    "search_chunk_configuration",
]
