"""DistributedLogger: Python `logging` with ColossalAI's `ranks=` argument, one per name.

`get_dist_logger()` (name "shardwise", the parent of every logger of this package, as
ColossalAI's "colossalai" is of its own) logs INFO and above to stderr, prefixed with the
rank, on the ranks a call names (every rank when `ranks` is None)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_loggers: dict[str, DistributedLogger] = {}


class DistributedLogger:
    """A named logger whose calls take the ranks to log on.

    Args:
        name: the `logging` logger's name; one DistributedLogger per name (use
            `get_dist_logger`).
    """

    def __init__(self, name: str) -> None:
        if name in _loggers:
            raise ValueError(
                f"a DistributedLogger named {name!r} exists already: use get_dist_logger({name!r})"
            )
        self._logger = logging.getLogger(name)
        self._logger.setLevel(logging.INFO)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s - %(levelname)s: %(message)s"))
        self._logger.addHandler(handler)
        self._logger.propagate = False
        _loggers[name] = self

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def set_level(self, level: str) -> None:
        """Log `level` ("DEBUG", "INFO", "WARNING", "ERROR") and above."""
        if level not in _LEVELS:
            raise ValueError(f"level must be one of {_LEVELS}, got {level!r}")
        self._logger.setLevel(getattr(logging, level))

    def log_to_file(
        self, path: str | Path, mode: str = "a", level: str = "INFO", suffix: str | None = None
    ) -> None:
        """Also write `level` and above to `path` (a directory gets `rank_<r>[_<suffix>].log`;
        a file path is used as it is).

        Args:
            path: a directory or a file.
            mode: the file's open mode.
            level: the lowest level written.
            suffix: added to the per-rank file name in a directory.
        """
        if level not in _LEVELS:
            raise ValueError(f"level must be one of {_LEVELS}, got {level!r}")
        target = Path(path)
        if target.is_dir():
            name = f"rank_{self.rank}" + (f"_{suffix}" if suffix else "") + ".log"
            target = target / name
        handler = logging.FileHandler(target, mode)
        handler.setLevel(getattr(logging, level))
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        self._logger.addHandler(handler)

    def _log(self, level: int, message: str, ranks: Sequence[int] | None) -> None:
        if ranks is None or self.rank in ranks:
            self._logger.log(level, "[rank %d] %s", self.rank, message, stacklevel=3)

    def info(self, message: str, ranks: Sequence[int] | None = None) -> None:
        self._log(logging.INFO, message, ranks)

    def warning(self, message: str, ranks: Sequence[int] | None = None) -> None:
        self._log(logging.WARNING, message, ranks)

    def debug(self, message: str, ranks: Sequence[int] | None = None) -> None:
        self._log(logging.DEBUG, message, ranks)

    def error(self, message: str, ranks: Sequence[int] | None = None) -> None:
        self._log(logging.ERROR, message, ranks)


def get_dist_logger(name: str = "shardwise") -> DistributedLogger:
    """The DistributedLogger named `name`, made on first use.

    Args:
        name: the logger's name (default "shardwise", the package's own).
    """
    return _loggers.get(name) or DistributedLogger(name)


def disable_existing_loggers(
    include: Sequence[str] | None = None, exclude: Sequence[str] = ("shardwise",)
) -> None:
    """Set existing loggers to WARNING: those named in `include`, or, when it is None, every
    one not named in `exclude`.

    Args:
        include: the loggers to quiet, or None.
        exclude: the loggers to leave alone when `include` is None.
    """
    for name in list(logging.Logger.manager.loggerDict):
        if (name in include) if include is not None else (name not in exclude):
            logging.getLogger(name).setLevel(logging.WARNING)
