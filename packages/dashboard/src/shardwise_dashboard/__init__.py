"""Live dashboard of shardwise training runs (no torch: it reads the JSON event schema)."""

import importlib.metadata

# The installed distribution's version: packages/dashboard/pyproject.toml holds the one number.
try:
    __version__ = importlib.metadata.version("shardwise-dashboard")
except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"
