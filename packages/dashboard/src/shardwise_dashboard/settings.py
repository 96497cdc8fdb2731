"""What one dashboard server is configured with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """Configuration of `create_app`.

    Args:
        db_path: the SQLite file holding run history (created when missing).
        token: when set, ingestion must present `Authorization: Bearer <token>`.
        max_body_bytes: largest request body accepted; larger ones get 413.
        stream_queue_size: messages a live stream may have pending before it resynchronises.
        keepalive_s: seconds between keep-alive comments on an idle live stream.
    """

    db_path: Path
    token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    stream_queue_size: int = 1024
    keepalive_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.db_path, Path):
            raise TypeError(f"db_path must be a pathlib.Path, got {self.db_path!r}")
        if self.token is not None and (not self.token or self.token != self.token.strip()):
            raise ValueError(
                "token must be a non-empty string without surrounding spaces, got "
                f"{self.token!r}; pass None for no token"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.stream_queue_size < 1:
            raise ValueError(f"stream_queue_size must be >= 1, got {self.stream_queue_size}")
        if self.keepalive_s <= 0:
            raise ValueError(f"keepalive_s must be > 0, got {self.keepalive_s}")
