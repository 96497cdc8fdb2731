"""Live dashboard of shardwise training runs (no torch: it reads the JSON event schema)."""

__version__ = "0.1.0"
