"""A transformers.Trainer callback that trains with the shardwise engine."""

__version__ = "0.1.0"
