"""The largest GPT each engine trains on this host, every engine under the same flags.

    python benchmarks/bench_largest.py --engines fsdp2-bf16,zero3-disk-bf16 --meta \\
        --disk-dir /work/benchdisk --chunk-numel 16777216 --out big.json --results RESULTS.md
    python benchmarks/bench_largest.py --engines ddp,zero2,fsdp2,zero3-cuda --layers 2 --out s.json

For each engine in turn, the GPT's depth grows at width `--n-embd` (vocabulary 32768, untied
head; doubling from `--start-layers`, then bisecting) until an attempt fails or the ranks'
resident sets together pass `--limit-gib`. `--layers 48,56,64` tries those depths for every
engine instead of searching; `--layers fsdp2-bf16=48,56;zero3-disk-bf16=80,96` gives each
engine its own. Each attempt is `bench_memory.py one` under `torchrun` in processes of its
own (`--steps` steps of one 16-token sequence per rank: the model state decides what fits),
bounded by `--attempt-timeout`, with a watchdog polling the resident set of its process tree
that stops it before the host runs short (bench_memory.launch); the engines are
bench_memory's (`fsdp2-bf16`, `zero3-disk-bf16`, ... see its docstring).

One set of flags applies to every engine of a run and is written in the results block's
header: `--meta` (the model built on the meta device, each engine initialising it shard by
shard), `--malloc-mmap-threshold` (glibc's `MALLOC_MMAP_THRESHOLD_` in every attempt's
environment, so freed chunk buffers go back to the system instead of staying in the heap; 0
leaves it unset, removing an inherited value), fused AdamW (`--foreach`: torch's foreach AdamW
for every engine), `--steps`, `--chunk-numel` (stage 3's chunk size; default: searched).

Columns: the largest depth that trained, its parameters, the highest resident set of the
attempt's process tree (both ranks and the launcher), the median of rank 0's step times after
the first (blank with one step: the first step allocates the optimizer state and places it),
the parameters against the first engine listed, and every attempt with its outcome. A
zero3-disk attempt's files go to a directory of its own under `--disk-dir`, removed after it
(the disk tier keeps two slot files per chunk: 24 bytes per parameter across the ranks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from bench_memory import launch, write_block

GIB = 2**30


def _layer_plan(spec: str | None, engines: list[str]) -> dict[str, list[int] | None]:
    """Depths to try per engine (None: search) from `--layers`."""
    if not spec:
        return dict.fromkeys(engines)
    if "=" not in spec:
        depths = [int(n) for n in spec.split(",")]
        return {engine: depths for engine in engines}
    plan: dict[str, list[int] | None] = dict.fromkeys(engines)
    for part in spec.split(";"):
        engine, depths = part.split("=")
        if engine not in plan:
            raise SystemExit(f"--layers names {engine!r}, not one of --engines")
        plan[engine] = [int(n) for n in depths.split(",")]
    return plan


def _environment(threshold: int) -> dict[str, str]:
    environment = dict(os.environ)
    environment.pop("MALLOC_MMAP_THRESHOLD_", None)
    if threshold:
        environment["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    return environment


def _extra(args: argparse.Namespace, disk_dir: str | None) -> list[str]:
    """The options every attempt passes to bench_memory.py one."""
    return [
        *["--seq", "16", "--sequences", "1"],
        *(["--meta"] if args.meta else []),
        *(["--foreach"] if args.foreach else []),
        *(["--disk-dir", disk_dir] if disk_dir else []),
        *(["--chunk-numel", str(args.chunk_numel)] if args.chunk_numel else []),
    ]


def _attempt(args: argparse.Namespace, engine: str, layers: int, scratch: Path) -> dict[str, Any]:
    out = scratch / f"{engine}-{layers}.json"
    disk_dir = None
    if args.disk_dir and "disk" in engine:
        disk_dir = tempfile.mkdtemp(prefix=f"{engine}-{layers}-", dir=args.disk_dir)
    started = time.perf_counter()
    try:
        outcome, highest = launch(
            engine,
            f"L{layers}x{args.n_embd}",
            args.steps,
            out,
            args.attempt_timeout,
            args.limit_gib,
            args.cpu,
            extra=_extra(args, disk_dir),
            ranks=args.ranks,
            env=_environment(args.malloc_mmap_threshold),
        )
    finally:
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
    run = json.loads(out.read_text()) if outcome == "ok" else None
    record = {
        "layers": layers,
        "outcome": outcome,
        "params": run["params"] if run else None,
        "highest_gib": round(highest, 2),
        "seconds": round(time.perf_counter() - started, 1),
        "step_seconds": run["ranks"][0]["step_seconds"] if run else None,
        "io_per_step": run["ranks"][0]["io_per_step"] if run else None,
    }
    print(
        f"{engine} {layers} layers: {outcome} ({highest:.1f} GiB, {record['seconds']:.0f} s)",
        flush=True,
    )
    return record


def _search(args: argparse.Namespace, engine: str, depths: list[int] | None, scratch: Path) -> Any:
    attempts: list[dict[str, Any]] = []

    def fits(layers: int) -> bool:
        attempts.append(_attempt(args, engine, layers, scratch))
        return bool(attempts[-1]["outcome"] == "ok")

    if depths:
        for layers in depths:
            fits(layers)
    else:
        low, high = 0, args.start_layers
        while fits(high):
            low, high = high, high * 2
        while high - low > max(1, low // 8):
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
    best = max(
        (a for a in attempts if a["outcome"] == "ok"), key=lambda a: a["layers"], default=None
    )
    return {"largest": best, "attempts": attempts}


def _host() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if "model name" in ln), "")
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
        "torch": torch.__version__,
    }


def _source() -> str:
    """The commit of the shardwise the attempts import, and whether its packages differ."""
    import shardwise

    def git(*words: str) -> str:
        where = str(Path(shardwise.__file__).parent)
        return subprocess.run(
            ["git", "-C", where, *words], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit, changed = (
            git("rev-parse", "--short", "HEAD"),
            git("status", "--porcelain", ":/packages"),
        )
    except (OSError, subprocess.CalledProcessError):
        return "shardwise outside git"
    return f"shardwise at {commit}" + (" with uncommitted changes" if changed else "")


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def largest(args: argparse.Namespace, command: str) -> dict[str, Any]:
    engines = args.engines.split(",")
    if any("disk" in e for e in engines) and not args.disk_dir:
        raise SystemExit("the zero3-disk engines need --disk-dir")
    plan = _layer_plan(args.layers, engines)
    result: dict[str, Any] = {
        "kind": "largest",
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": _host(),
        "source": _source(),
        "load_start": _load(),
        "width": args.n_embd,
        "steps": args.steps,
        "limit_gib": args.limit_gib,
        "meta": args.meta,
        "foreach": args.foreach,
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
        "chunk_numel": args.chunk_numel,
        "ranks": args.ranks,
        "note": args.note,
    }
    if args.disk_dir:
        result["disk_free_gib"] = round(shutil.disk_usage(args.disk_dir).free / GIB, 1)
    started = time.perf_counter()
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for engine in engines:
            found[engine] = _search(args, engine, plan[engine], Path(scratch))
    result.update(
        engines=found, load_end=_load(), minutes=round((time.perf_counter() - started) / 60, 1)
    )
    return result


def step_median(step_seconds: list[float] | None) -> float | None:
    """The median of a run's steps after the first (None with one step)."""
    later = (step_seconds or [])[1:]
    return statistics.median(later) if later else None


def lines(result: dict[str, Any]) -> list[str]:
    host = result["host"]
    flags = [
        "the model built on the meta device and initialised shard by shard by each engine"
        if result["meta"]
        else "the model built whole, then wrapped",
        f"`MALLOC_MMAP_THRESHOLD_={result['malloc_mmap_threshold']}` in every attempt's environment"
        if result["malloc_mmap_threshold"]
        else "`MALLOC_MMAP_THRESHOLD_` unset",
        "foreach AdamW" if result["foreach"] else "fused AdamW",
        f"{result['steps']} steps per attempt of one 16-token sequence per rank",
        f"stage-3 chunks of {result['chunk_numel']:,} elements"
        if result["chunk_numel"]
        else "stage 3's searched chunk size",
    ]
    disk = f", {result['disk_free_gib']:g} GiB free on the disk tier's disk" * (
        "disk_free_gib" in result
    )
    header = (
        f"Written by `{result['command']}` on {result['date']} ({host['cpu'] or 'CPU'}, "
        f"{host['cores']} cores, {host['memory_gib']:g} GiB, torch {host['torch']}, "
        f"{result['source']}{disk}; "
        f"load average 1/5/15 min {result['load_start']} at the start, {result['load_end']} "
        f"at the end, {result['minutes']:g} minutes in all). Every engine under the same flags: "
        f"GPTs of width {result['width']} (vocabulary 32768, untied head), {result['ranks']} "
        f"ranks, {', '.join(flags)}; the ranks' resident sets together kept under "
        f"{result['limit_gib']:g} GiB by a watchdog."
        + (f" {result['note']}" if result["note"] else "")
        + " Peak GiB: the highest resident set of the attempt's process tree (ranks and"
        " launcher); step s: the median of rank 0's steps after the first."
    )
    table = [
        f"| engine | largest (layers) | parameters | peak GiB ({result['ranks']} ranks) | step s "
        f"| parameters vs {next(iter(result['engines']))} | attempts (layers: outcome) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    first = next(iter(result["engines"].values()))["largest"]
    for engine, found in result["engines"].items():
        best = found["largest"]
        tried = ", ".join(f"{a['layers']}: {a['outcome']}" for a in found["attempts"])
        if best is None:
            table.append(f"| {engine} | none | | | | | {tried} |")
            continue
        step = step_median(best["step_seconds"])
        ratio = best["params"] / first["params"] if first else None
        table.append(
            f"| {engine} | {best['layers']} | {best['params']:,} | {best['highest_gib']:.1f} | "
            f"{'' if step is None else f'{step:.1f}'} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} | {tried} |"
        )
    title = "**Largest GPT on this host, every engine under the same flags**"
    return [title, "", header, "", *table]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", required=True, help="comma-separated, bench_memory's names")
    parser.add_argument("--out", required=True, help="the json of every attempt")
    parser.add_argument("--results", type=Path, help="write the table into this markdown file")
    parser.add_argument("--results-block", default="bench_largest", help="the block's name")
    parser.add_argument("--layers", help="depths to try: 48,56 or fsdp2=48,56;zero2=64")
    parser.add_argument("--n-embd", type=int, default=1024, help="the GPT's width")
    parser.add_argument("--start-layers", type=int, default=8, help="the search's first depth")
    parser.add_argument("--steps", type=int, default=2, help="steps of every attempt")
    parser.add_argument("--limit-gib", type=float, default=20.0, help="all ranks' resident sets")
    parser.add_argument("--attempt-timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per attempt")
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU where CUDA is there")
    parser.add_argument("--meta", action="store_true", help="build on the meta device")
    parser.add_argument("--foreach", action="store_true", help="foreach AdamW instead of fused")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=131072,
        help="MALLOC_MMAP_THRESHOLD_ of every attempt, in bytes (0: unset)",
    )
    parser.add_argument("--chunk-numel", type=int, help="stage 3's chunk size in elements")
    parser.add_argument("--disk-dir", help="the disk tier's directory (zero3-disk engines)")
    parser.add_argument("--note", default="", help="a sentence for the block's header")
    args = parser.parse_args()
    niceness = os.nice(0)
    command = (f"nice -n {niceness} " if niceness else "") + shlex.join(
        ["python", "benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]]
    )
    result = largest(args, command)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for line in lines(result)[4:]:
        print(line)
    if args.results is not None:
        write_block(args.results, args.results_block, lines(result))


if __name__ == "__main__":
    main()
