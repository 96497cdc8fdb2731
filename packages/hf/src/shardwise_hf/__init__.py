"""Train a transformers.Trainer script sharded with the shardwise engine: one callback.

trainer = Trainer(model=model, args=args, train_dataset=data,
                  callbacks=[ShardwiseCallback(zero_stage=3)])
"""

from shardwise_hf.callback import ShardwiseCallback
from shardwise_hf.compat import check_transformers_version

__version__ = "0.1.0"

__all__ = ["ShardwiseCallback", "check_transformers_version"]
