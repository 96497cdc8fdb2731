"""PyTorch Lightning strategies over the shardwise engine."""

__version__ = "0.1.0"
