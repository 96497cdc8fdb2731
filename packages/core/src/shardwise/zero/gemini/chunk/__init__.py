"""`colossalai.zero.gemini.chunk`'s path: the chunk-size search a script may call itself."""

from shardwise.zero.gemini.chunk.search_utils import search_chunk_configuration

__all__ = ["search_chunk_configuration"]
