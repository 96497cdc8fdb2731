"""One interleaved run read several ways: which steps a timing keeps decides an engine's ratio.

    python benchmarks/ab_views.py r.json --pairs zero2+defaults/ddp,zero3-cuda+defaults/fsdp2

Reads a `bench_ab.py` result written with `--timing outside` (every step kept, with its round
and its place in the turn) and prints each pair's ratio of medians and of means over: every
step; every step but each turn's first (the turn timing's rule); every step of the rounds
after the first; the turns' first steps alone; then each engine's median step and the part of
it spent in the barrier after the step (what the turn timing leaves out). Where two benchmarks
disagree about the same engines, the view that moves the ratio names the cause.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

Step = list[float]  # [round, place in the turn, ms, ms of it in the barrier after the step]

VIEWS: dict[str, Callable[[Step], bool]] = {
    "every step": lambda step: True,
    "each turn's first left out": lambda step: step[1] > 0,
    "first round left out": lambda step: step[0] > 0,
    "turns' first steps alone": lambda step: step[1] == 0,
}


def ratios(summary: dict, pair: str) -> dict[str, tuple[float, float]]:
    """`pair` ("a/b") as (ratio of medians, ratio of means) under each view."""
    first, second = pair.split("/")
    engines = summary["engines"]
    for name in (first, second):
        if name not in engines:
            raise ValueError(f"engine {name!r} is not in the run (it has {list(engines)})")
    out = {}
    for view, keep in VIEWS.items():
        a = [step[2] for step in engines[first]["every_step"] if keep(step)]
        b = [step[2] for step in engines[second]["every_step"] if keep(step)]
        out[view] = (
            statistics.median(a) / statistics.median(b),
            statistics.fmean(a) / statistics.fmean(b),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result")
    parser.add_argument("--pairs", required=True, help="comma-separated a/b engine pairs")
    args = parser.parse_args()
    with open(args.result) as handle:
        summary = json.load(handle)
    if summary.get("timing") != "outside":
        raise SystemExit(f"{args.result} was not written with --timing outside")
    print("| pair | view | ratio of medians | ratio of means |")
    print("| --- | --- | ---: | ---: |")
    for pair in args.pairs.split(","):
        for view, (median, mean) in ratios(summary, pair).items():
            print(f"| {pair} | {view} | {median:.3f} | {mean:.3f} |")
    print()
    print("| engine | median ms | median ms in the barrier after the step |")
    print("| --- | ---: | ---: |")
    for name, run in summary["engines"].items():
        steps = run["every_step"]
        total = statistics.median(step[2] for step in steps)
        tail = statistics.median(step[3] for step in steps)
        print(f"| {name} | {total:.1f} | {tail:.1f} |")


if __name__ == "__main__":
    main()
