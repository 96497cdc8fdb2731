"""`colossalai.logging`'s path: a logger that logs on the ranks asked (`get_dist_logger`), and
`disable_existing_loggers`."""

from shardwise.logging.dist_logger import (
    DistributedLogger,
    disable_existing_loggers,
    get_dist_logger,
)

__all__ = ["DistributedLogger", "disable_existing_loggers", "get_dist_logger"]
