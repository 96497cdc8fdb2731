"""Keeping history bounded: old runs go, old steps are thinned, the file has a size cap.

One pass (run by the writer thread every minute, between groups of batches):
1. runs from which nothing arrived for `max_age_s` are deleted;
2. events older than `thin_after_s` (by the ranks' clocks) are thinned: of step events, every
   `thin_every`-th step and every overflow are kept; of chunk snapshots every
   (10 x `thin_every`)-th step and each rank's latest; the rest is deleted. Only rows that
   arrived since the last pass are looked at (a range of row ids), so a pass costs what a
   minute of ingestion wrote, not the size of the history;
3. while the pages in use exceed `max_bytes`, the run heard from longest ago is deleted; the
   last one left is thinned deeper instead: the older half of its steps to every 100th, then
   (at later passes, if still over) every 1,000th, and so on, overflows and its latest chunk
   snapshots kept, so even one endless run stays near the cap.
SQLite reuses the pages freed, so the file stops growing; it does not shrink (VACUUM would
block ingestion for as long as it takes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from shardwise_dashboard.storage import RunStore

_log = logging.getLogger("shardwise_dashboard")


@dataclass(kw_only=True, slots=True)
class RetentionReport:
    """What one pass deleted."""

    runs_deleted: list[str] = field(default_factory=list)
    events_thinned: int = 0
    used_bytes: int = 0


class Retention:
    """The retention policy of one store.

    Args:
        store: the history.
        max_age_s: delete runs silent for longer than this; None keeps them.
        max_bytes: delete the oldest runs while the database uses more; None for no cap.
        thin_after_s: thin events older than this; None keeps every event.
        thin_every: keep every this-many-th step of thinned history.
    """

    def __init__(
        self,
        store: RunStore,
        *,
        max_age_s: float | None,
        max_bytes: int | None,
        thin_after_s: float | None,
        thin_every: int = 10,
    ) -> None:
        if thin_every < 2:
            raise ValueError(f"thin_every must be >= 2, got {thin_every}")
        self.store = store
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.thin_after_s = thin_after_s
        self.thin_every = thin_every
        self._thinned_up_to = 0  # row id: everything at or below it was looked at
        self._deep_every: dict[str, int] = {}  # per run: how far its older half is thinned
        self._warned_single_run = False

    def used_bytes(self) -> int:
        """Bytes of the database's pages in use (free pages are reused, not counted)."""
        ((pages,),) = self.store.execute("PRAGMA page_count")
        ((free,),) = self.store.execute("PRAGMA freelist_count")
        ((size,),) = self.store.execute("PRAGMA page_size")
        return int((pages - free) * size)

    def run_once(self) -> RetentionReport:
        """One pass of the policy; returns what it did."""
        report = RetentionReport()
        now = self.store.clock()
        if self.max_age_s is not None:
            for (run_id,) in self.store.execute(
                "SELECT run_id FROM runs WHERE coalesce(received, last_seen) < ?",
                (now - self.max_age_s,),
            ):
                self._delete_run(run_id)
                report.runs_deleted.append(run_id)
        if self.thin_after_s is not None:
            report.events_thinned = self._thin(now - self.thin_after_s)
        report.used_bytes = self.used_bytes()
        if self.max_bytes is not None:
            while report.used_bytes > self.max_bytes:
                oldest = self.store.execute(
                    "SELECT run_id FROM runs ORDER BY coalesce(received, last_seen) LIMIT 2"
                )
                if len(oldest) < 2:
                    if oldest and self._thin_deeper(oldest[0][0]):
                        report.events_thinned += 1
                        report.used_bytes = self.used_bytes()
                        break  # one step deeper per pass: the next pass sees the result
                    if not self._warned_single_run:
                        self._warned_single_run = True
                        _log.warning(
                            "the dashboard's database uses %d bytes, over its cap of %d, "
                            "with one run left, thinned as far as it goes: it is kept",
                            report.used_bytes,
                            self.max_bytes,
                        )
                    break
                self._delete_run(oldest[0][0])
                report.runs_deleted.append(oldest[0][0])
                report.used_bytes = self.used_bytes()
        return report

    def _thin_deeper(self, run_id: str) -> bool:
        """Thin the older half of the run's steps ten times further than before; False when
        there is nothing left to thin."""
        every = self._deep_every.get(run_id, self.thin_every) * 10
        ((low, high),) = self.store.execute(
            "SELECT min(step), max(step) FROM events WHERE run_id = ? AND type = 'step'",
            (run_id,),
        )
        if low is None or every > high:
            return False
        middle = (low + high) // 2
        self.store.execute("BEGIN IMMEDIATE")
        try:
            self.store.execute(
                "DELETE FROM events WHERE run_id = ? AND type = 'step' AND step < ? "
                "AND step % ? != 0 AND NOT overflow",
                (run_id, middle, every),
            )
            self.store.execute(
                "DELETE FROM events WHERE run_id = ? AND type = 'chunks' AND step < ? "
                "AND step % ? != 0",
                (run_id, middle, 10 * every),
            )
        except BaseException:
            self.store.execute("ROLLBACK")
            raise
        self.store.execute("COMMIT")
        self._deep_every[run_id] = every
        return True

    def _delete_run(self, run_id: str) -> None:
        self.store.execute("BEGIN IMMEDIATE")
        try:
            for table in ("events", "ranks", "runs"):
                self.store.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))
        except BaseException:
            self.store.execute("ROLLBACK")
            raise
        self.store.execute("COMMIT")

    def _last_id_before(self, cutoff: float) -> int | None:
        """The last row id whose event is older than `cutoff`, by bisection over row ids
        (events arrive in about time order): a few lookups, where a scan of the time column
        would read the whole newer history at every pass while the writer waits."""
        ((high,),) = self.store.execute("SELECT max(id) FROM events")
        low = self._thinned_up_to  # known to be before the cutoff (or 0)
        if high is None or high <= low:
            return None
        while low < high:
            middle = (low + high + 1) // 2
            row = self.store.execute(
                "SELECT time FROM events WHERE id >= ? ORDER BY id LIMIT 1", (middle,)
            )
            if row and row[0][0] < cutoff:
                low = middle
            else:
                high = middle - 1
        return low if low > self._thinned_up_to else None

    def _thin(self, cutoff: float) -> int:
        upto = self._last_id_before(cutoff)
        if upto is None:
            return 0
        before = self._changes()
        self.store.execute("BEGIN IMMEDIATE")
        try:
            self.store.execute(
                "DELETE FROM events WHERE id > ? AND id <= ? AND type = 'step' "
                "AND step % ? != 0 AND NOT overflow",
                (self._thinned_up_to, upto, self.thin_every),
            )
            self.store.execute(
                "DELETE FROM events WHERE id > ? AND id <= ? AND type = 'chunks' "
                "AND step % ? != 0 AND step != (SELECT coalesce(placement_step, -1) FROM ranks k "
                "WHERE k.run_id = events.run_id AND k.rank = events.rank)",
                (self._thinned_up_to, upto, 10 * self.thin_every),
            )
        except BaseException:
            self.store.execute("ROLLBACK")
            raise
        self.store.execute("COMMIT")
        self._thinned_up_to = upto
        return self._changes() - before

    def _changes(self) -> int:
        # Rows changed on the store's connection so far: the difference is what was deleted
        # (this thread is the only writer), without counting the whole table.
        ((count,),) = self.store.execute("SELECT total_changes()")
        return int(count)
