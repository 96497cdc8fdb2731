"""Step time of shardwise ZeRO stages 2 and 3 against torch DDP and FSDP2, on one model and run.

    python benchmarks/run.py [--quick] [--repeats N]

Runs ``benchmarks/step_bench.py`` under torchrun once per engine (2 gloo ranks by default),
collects the JSON summaries and writes ``benchmarks/RESULTS.md``: the machine, the exact
commands, a row per engine and the ratios zero2/ddp and zero3/fsdp2, plus the bytes each
shardwise engine sent per step against the ZeRO analysis. Step times drift between runs on
shared machines, so ratios are only taken between figures of the same run; with ``--repeats``
the engines run interleaved (all engines, then all again) and each figure is the median over
every measured step of every repeat.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINES = ("ddp", "fsdp2", "zero2", "zero3")

FULL_MODEL = {"n-layer": 4, "n-embd": 256, "vocab": 8192, "seq": 128, "batch": 8}
FULL_STEPS = {"warmup": 3, "steps": 10}
QUICK_MODEL = {"n-layer": 2, "n-embd": 64, "vocab": 512, "seq": 32, "batch": 8}
QUICK_STEPS = {"warmup": 1, "steps": 3}

# Collective traffic per step in units of psi * 4 bytes * (N-1)/N (the ZeRO paper's analysis,
# fp32): reduce-scatter of gradients plus all-gather of parameters for stage 2, and a second
# parameter all-gather (recomputed in backward) for stage 3.
ZERO_TRAFFIC_MULTIPLE = {"zero2": 2, "zero3": 3}


@dataclass
class EngineRuns:
    """Every summary one engine produced, and the error of a run that failed, if any."""

    summaries: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def median_ms(self) -> float | None:
        """Median over all measured steps of all repeats, or None when nothing ran."""
        steps = [ms for summary in self.summaries for ms in summary["step_ms"]]
        return statistics.median(steps) if steps else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the driver."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps (a smoke run)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all engines")
    parser.add_argument("--world", type=int, default=2, help="ranks (gloo processes)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per run")
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def shown_path(path: str | Path) -> str:
    """`path` relative to the repository root when inside it, as a user would type it."""
    # Not resolved: the virtual environment's python is a symlink to outside the repository.
    try:
        return str(Path(os.path.abspath(path)).relative_to(ROOT))
    except ValueError:
        return str(path)


def step_command(engine: str, out: Path, options: dict[str, int], world: int) -> list[str]:
    """The torchrun command line for one engine (torchrun invoked as a module, so the
    interpreter running this driver, and its environment, runs the ranks too)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}", str(HERE / "step_bench.py"),
        "--engine", engine, "--out", str(out),
    ]  # fmt: skip
    for name, value in options.items():
        command += [f"--{name}", str(value)]
    return command


def display(command: list[str]) -> str:
    """`command` as run, with the environment it got and paths relative to the repository."""
    words = [shown_path(word) if word.startswith(str(ROOT)) else word for word in command]
    return "OMP_NUM_THREADS=1 " + shlex.join(words)


def run_engine(command: list[str], timeout: int) -> str | None:
    """Run one engine's ranks; None on success, else the reason and the tail of its output."""
    # One OpenMP thread per rank: the ranks share the machine's cores, and oversubscribing
    # them would time the scheduler rather than the engines.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        result = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        output = (expired.stderr or b"")[-4000:]
        text = output.decode(errors="replace") if isinstance(output, bytes) else output
        return f"timed out after {timeout} s\n{text}"
    if result.returncode != 0:
        return f"exit status {result.returncode}\n{(result.stdout + result.stderr)[-6000:]}"
    return None


def machine() -> dict[str, str]:
    """CPU model, core count, Python and torch versions of this machine."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _ratio(numerator: float | None, denominator: float | None, digits: int = 3) -> str:
    if numerator is None or denominator is None:
        return "n/a (engine failed)"
    return f"{numerator / denominator:.{digits}f}"


def _bytes(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def render(
    results: dict[str, EngineRuns],
    commands: list[str],
    driver: str,
    options: dict[str, int],
    world: int,
    elapsed_s: float,
    json_dir: Path,
) -> str:
    """The Markdown report: machine, commands, per-engine table, same-run ratios, failures."""
    info = machine()
    params = next((r.summaries[0]["params"] for r in results.values() if r.summaries), None)
    ms = {engine: runs.median_ms() for engine, runs in results.items()}
    last = {
        engine: runs.summaries[-1] if runs.summaries else None for engine, runs in results.items()
    }
    psi = f"{params:,}" if params is not None else "n/a"
    model = ", ".join(f"{name} {value}" for name, value in options.items())
    lines = [
        "# Step-time benchmark: shardwise ZeRO vs torch DDP / FSDP2",
        "",
        f"Written by `{driver}` on {datetime.date.today().isoformat()} "
        f"(the whole run took {elapsed_s / 60:.1f} min).",
        "",
        f"- Machine: {info['cpu']}, {info['cores']} cores; Python {info['python']}, "
        f"torch {info['torch']}",
        f"- {world} ranks over gloo on this machine, one thread each (`OMP_NUM_THREADS=1`, "
        "`torch.set_num_threads(1)`)",
        f"- Model: `shardwise.testing.GPT`, tied embeddings, n_head 4, psi = {psi} parameters, "
        f"fp32; {model} (batch is global, split over the ranks)",
        "- Optimizer: `torch.optim.AdamW(lr=1e-3, fused=True)` in every engine",
        "- Engines: `ddp` = `DistributedDataParallel`; `fsdp2` = `fully_shard` on each block and "
        'on the root (`init_device_mesh("cpu", (world,))`); `zero2` / `zero3` = '
        "`shardwise.zero_model_wrapper` stage 2 (reduce_bucket_size 4 Mi elements) / stage 3 "
        "(chunk_size_numel 4 Mi elements), device cpu",
        "- A step is forward, backward and optimizer step, timed with `time.perf_counter()` on "
        "rank 0 after a `dist.barrier()`; each figure is the median over the measured steps "
        "(warmup steps excluded)",
        "",
        "## Results",
        "",
        "| engine | median ms/step | loss after the run | bytes sent/step/rank "
        "| model-state bytes/rank |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for engine, summary in last.items():
        if summary is None:
            lines.append(f"| {engine} | failed | | | |")
            continue
        lines.append(
            f"| {engine} | {ms[engine]:.1f} | {summary['loss']:.4f} | "
            f"{_bytes(summary['bytes_sent_per_step'])} | {_bytes(summary['model_state_bytes'])} |"
        )
    lines += [
        "",
        "Bytes sent count what one rank sends per step in shardwise's collectives "
        "(`model.comm_stats`, ring algorithm); model state is `model.memory_report()` plus "
        "`optimizer.state_bytes()` (parameters, gradients, Adam moments). torch's engines expose "
        "neither counter, hence n/a.",
    ]
    breakdown = [
        f"{engine}: "
        + ", ".join(f"{kind} {value:,}" for kind, value in summary["model_state"].items())
        for engine, summary in last.items()
        if summary is not None and summary["model_state"]
    ]
    if breakdown:
        lines += ["", "Model state by kind (bytes/rank): " + "; ".join(breakdown) + "."]

    lines += [
        "",
        "## Ratios (same run)",
        "",
        "| ratio | value |",
        "| --- | ---: |",
        f"| zero2 / ddp step time | {_ratio(ms['zero2'], ms['ddp'])} |",
        f"| zero3 / fsdp2 step time | {_ratio(ms['zero3'], ms['fsdp2'])} |",
        f"| fsdp2 / ddp step time (context) | {_ratio(ms['fsdp2'], ms['ddp'])} |",
    ]
    if params is not None:
        for engine, multiple in ZERO_TRAFFIC_MULTIPLE.items():
            theory = multiple * params * 4 * (world - 1) / world
            summary = last[engine]
            sent = summary["bytes_sent_per_step"] if summary else None
            lines.append(
                f"| {engine} bytes sent / ZeRO analysis ({multiple}psi x 4 B x (N-1)/N = "
                f"{theory:,.0f}) | {_ratio(sent, theory, 4)} |"
            )
    failed = {engine: runs.error for engine, runs in results.items() if runs.error}
    if failed:
        lines += ["", "## Failures", ""]
        for engine, error in failed.items():
            lines += [f"`{engine}` failed; the other engines' figures above are unaffected.", ""]
            lines += ["```", *(error or "").rstrip().splitlines()[-40:], "```", ""]
    lines += [
        "",
        "## Commands",
        "",
        f"Driver: `{driver}`, run from the repository root. It ran, in this order "
        f"(summaries under `{json_dir}`):",
        "",
        "```",
        *commands,
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run every engine, write the report, and return 1 if any engine failed."""
    args = parse_args(argv)
    options = {**(QUICK_MODEL if args.quick else FULL_MODEL)}
    options.update(QUICK_STEPS if args.quick else FULL_STEPS)
    driver = shlex.join(
        [
            shown_path(sys.executable),
            shown_path(__file__),
            *(argv if argv is not None else sys.argv[1:]),
        ]
    )
    # Kept after the run, so the raw per-step figures behind RESULTS.md can be inspected.
    json_dir = Path(tempfile.mkdtemp(prefix="shardwise-bench-"))
    results = {engine: EngineRuns() for engine in ENGINES}
    commands: list[str] = []
    total = args.repeats * len(ENGINES)
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for position, engine in enumerate(ENGINES, start=1):
            if results[engine].error:
                continue  # a failed engine is not retried; its error is already recorded
            out = json_dir / f"{engine}-{repeat + 1}.json"
            command = step_command(engine, out, options, args.world)
            commands.append(display(command))
            index = repeat * len(ENGINES) + position
            print(f"[{index}/{total}] {engine} (repeat {repeat + 1}) ...", flush=True)
            run_start = time.perf_counter()
            error = run_engine(command, args.timeout)
            if error is None and not out.exists():
                error = "the ranks exited without writing a summary"
            if error is not None:
                results[engine].error = error
                print(f"    {engine} FAILED: {error.splitlines()[0]}", flush=True)
                continue
            summary = json.loads(out.read_text())
            results[engine].summaries.append(summary)
            print(
                f"    {engine}: median {summary['median_ms']:.1f} ms/step, loss "
                f"{summary['loss']:.4f} ({time.perf_counter() - run_start:.0f} s)",
                flush=True,
            )
    report = render(
        results,
        commands,
        driver,
        options,
        args.world,
        time.perf_counter() - started,
        json_dir,
    )
    args.out.write_text(report)
    print(f"wrote {shown_path(args.out)}", flush=True)
    return 1 if any(runs.error for runs in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
