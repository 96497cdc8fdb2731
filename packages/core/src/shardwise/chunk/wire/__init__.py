"""A chunk's communication: the wire formats and the gather and reduce sides that carry them
(see [Note: wire formats] in formats.py)."""

from shardwise.chunk.wire.formats import ChunkWire, WireFormats
from shardwise.chunk.wire.gather import GatherWire, PayloadGather, QuantizedGather
from shardwise.chunk.wire.reduce import PayloadReduce, QuantizedReduce, ReduceWire

__all__ = [
    "ChunkWire",
    "GatherWire",
    "PayloadGather",
    "PayloadReduce",
    "QuantizedGather",
    "QuantizedReduce",
    "ReduceWire",
    "WireFormats",
]
