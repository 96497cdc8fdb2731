"""`colossalai.utils`' path: the names training scripts import from it."""

from shardwise.utils.common import get_current_device, set_seed

__all__ = ["get_current_device", "set_seed"]
