"""The one-screen overview of a run at any rank count: distributions across ranks per step,
placement per rank and chunk, and the ranks that stand out.

Everything here is computed from what `RunStore.overview_rows` reads (the rank rows and the
numeric columns of recent step events), never from event bodies, so a 1,024-rank run costs a
few milliseconds per refresh.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

METRICS = ("step_time_s", "sent_bytes", "moved_bytes", "mem_device", "mem_host")
"""Per-step metrics summarised across ranks (min / median / max), in step-row order."""

OUTLIER_WINDOW = 10
"""Steps over which a rank's step time and traffic are compared with the others'."""

NOTABLE_RATIO = 1.1
"""A largest value at least this many times the median is an outlier worth a look; below it
nothing of that kind is listed (ranks alike, or one rank, stand out in nothing)."""


def _median(ordered: list[float]) -> float:
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def distributions(step_rows: list[tuple[Any, ...]], since_step: int) -> dict[str, Any]:
    """Per step after `since_step`: the number of ranks reporting it and, per metric, the
    min, median and max across them."""
    by_step: dict[int, list[tuple[Any, ...]]] = defaultdict(list)
    for row in step_rows:
        if row[0] > since_step:
            by_step[row[0]].append(row)
    steps = sorted(by_step)
    out: dict[str, Any] = {"step": steps, "ranks": [len(by_step[s]) for s in steps]}
    for column, metric in enumerate(METRICS, start=2):
        lows, mids, highs = [], [], []
        for step in steps:
            values = sorted(row[column] for row in by_step[step])
            lows.append(values[0])
            mids.append(_median(values))
            highs.append(values[-1])
        out[metric] = {"min": lows, "median": mids, "max": highs}
    return out


def _top(values: dict[int, float]) -> tuple[int, float, float] | None:
    """The rank with the largest value, its value, and the median of all."""
    if not values:
        return None
    rank = max(values, key=lambda r: (values[r], -r))
    return rank, values[rank], _median(sorted(values.values()))


def outliers(ranks: list[dict[str, Any]], step_rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """The ranks to look at first, most urgent first: warnings from the engine, failed and
    stale ranks, the first overflow, then the slowest step, the most host<->device traffic
    and the highest memory, each where it is at least NOTABLE_RATIO times the median of all
    ranks."""
    found: list[dict[str, Any]] = []
    warned: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rank in ranks:
        if rank["warning"] is not None:
            warned[rank["warning"]].append(rank)
    for text, group in warned.items():
        first = min(group, key=lambda r: r["rank"])
        found.append(
            {
                "kind": "warning",
                "label": "engine warning",
                "rank": first["rank"],
                "num_ranks": len(group),
                "step": first["warning_step"],
                "text": text,
                "active": any(r["skipped_in_a_row"] > 0 for r in group),
            }
        )
    for status in ("failed", "stale"):
        group = [r for r in ranks if r["status"] == status]
        if group:
            first = (
                min(group, key=lambda r: r["rank"])
                if status == "failed"
                else min(group, key=lambda r: r["received"])
            )
            found.append(
                {
                    "kind": status,
                    "label": "failed" if status == "failed" else "silent (stale)",
                    "rank": first["rank"],
                    "num_ranks": len(group),
                    "text": first["error"] if status == "failed" else None,
                    "received": first["received"],
                }
            )
    overflowed = [r for r in ranks if r["first_overflow"] is not None]
    if overflowed:
        first = min(
            overflowed, key=lambda r: (r["first_overflow"], r["first_overflow_time"], r["rank"])
        )
        found.append(
            {
                "kind": "overflow",
                "label": "overflow first seen",
                "rank": first["rank"],
                "num_ranks": len(overflowed),
                "step": first["first_overflow"],
            }
        )
    window_start = max((row[0] for row in step_rows), default=0) - OUTLIER_WINDOW
    time_sum: dict[int, float] = defaultdict(float)
    time_count: dict[int, int] = defaultdict(int)
    moved: dict[int, float] = defaultdict(float)
    memory: dict[int, tuple[int, float]] = {}
    for step, rank, step_time_s, _sent, moved_bytes, mem_device, mem_host, _ in step_rows:
        if step > window_start:
            time_sum[rank] += step_time_s
            time_count[rank] += 1
            moved[rank] += moved_bytes
        if rank not in memory or step >= memory[rank][0]:
            memory[rank] = (step, mem_device + mem_host)
    measured: tuple[tuple[str, str, dict[int, float], str], ...] = (
        ("slowest", "slowest step", {r: time_sum[r] / time_count[r] for r in time_sum}, "s"),
        ("traffic", "most host<->device traffic", dict(moved), "bytes"),
        ("memory", "highest memory", {r: float(m) for r, (_, m) in memory.items()}, "bytes"),
    )
    for kind, label, values, unit in measured:
        top = _top(values)
        if top is not None and top[1] > 0 and top[1] >= NOTABLE_RATIO * top[2]:
            top_rank, value, median = top
            found.append(
                {
                    "kind": kind,
                    "label": label,
                    "rank": top_rank,
                    "value": value,
                    "median": median,
                    "unit": unit,
                    "window": OUTLIER_WINDOW if kind != "memory" else 1,
                }
            )
    return found


def build(
    summary: dict[str, Any],
    ranks: list[dict[str, Any]],
    step_rows: list[tuple[Any, ...]],
    since_step: int = -1,
) -> dict[str, Any]:
    """The overview body: summary, one compact row per rank (with its placement letters),
    step distributions after `since_step`, and outliers."""
    counts: dict[str, int] = defaultdict(int)
    for rank in ranks:
        counts[rank["status"]] += 1
    return {
        **summary,
        "rank_status": dict(counts),
        "ranks": ranks,
        "steps": distributions(step_rows, since_step),
        "outliers": outliers(ranks, step_rows),
    }
