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
        busy_timeout_s: how long a write waits on a database another process has locked
            before the POST is answered 503 with Retry-After.
        stale_after_s: a run (or rank) not finished and silent for this long shows "stale".
        retain_days: runs silent for longer are deleted; None keeps them.
        max_db_bytes: over this, the runs heard from longest ago are deleted; None: no cap.
        thin_after_s: older steps are thinned to every `thin_every`-th (overflows kept);
            None keeps every step.
        thin_every: see thin_after_s.
        maintenance_interval_s: seconds between retention passes.
    """

    db_path: Path
    token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    stream_queue_size: int = 1024
    keepalive_s: float = 10.0
    busy_timeout_s: float = 1.0
    stale_after_s: float = 300.0
    retain_days: float | None = 30.0
    max_db_bytes: int | None = 4 * 2**30
    thin_after_s: float | None = 3600.0
    thin_every: int = 10
    maintenance_interval_s: float = 60.0

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
        for name in ("busy_timeout_s", "stale_after_s", "maintenance_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("retain_days", "max_db_bytes", "thin_after_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (or None for no limit), got {value}")
        if self.thin_every < 2:
            raise ValueError(f"thin_every must be >= 2, got {self.thin_every}")
