"""Train a transformers.Trainer script sharded with the shardwise engine: one callback.

trainer = Trainer(model=model, args=args, train_dataset=data,
                  callbacks=[ShardwiseCallback(zero_stage=3)])
"""

import importlib.metadata

from shardwise_hf.callback import ShardwiseCallback
from shardwise_hf.compat import check_transformers_version

# The installed distribution's version: packages/hf/pyproject.toml holds the one number.
try:
    __version__ = importlib.metadata.version("shardwise-hf")
except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

__all__ = ["ShardwiseCallback", "check_transformers_version"]
