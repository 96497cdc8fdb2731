"""The benchmark suite: every engine on the same model and ranks, ratios taken in one run.

    python benchmarks/suite.py [--quick] [--rounds 10]      (./dev bench runs it)

Writes benchmarks/RESULTS.md. Step times come from bench_ab.py: all engines in one process
group, each training its own copy of the model, taking turns of a few steps, round after round;
separate runs of one engine drift by several percent on these machines, while figures taken
turn by turn share the drift, so their ratios hold. Each engine then runs alone (bench_step.py)
for what only a process of its own shows: bytes sent, model-state bytes, peak memory, and the
share of a step spent in shardwise's own Python code (cProfile). Then step time against model
size and rank count, gloo's collectives, and HybridAdam against fused AdamW; then "auto"
placement against the static splits over a sweep of budgets (bench_auto.py) and hybrid against
full sharding (bench_hybrid.py), each writing its own block.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from report import render

HERE = Path(__file__).resolve().parent
# Interleaved in one process group for step times (see bench_ab.py), a group per comparison:
# fewer engines per process give each more turns in the same time.
AB_GROUPS = {
    "stage 2": ["ddp", "zero2", "zero2+sync"],
    # "+defaults": the chunk size a user gets without setting one, beside the tuned one.
    "stage 3": ["fsdp2", "zero3-cuda", "zero3-cuda+defaults", "fsdp1", "zero3-cpu"],
    "variants": ["ddp", "colo", "zero1", "zero2-rs", "zero2-ar", "fsdp2", "zero3-cuda-rs"],
}
# Run alone, for traffic, memory and telemetry's cost.
ALONE_ENGINES = [
    "ddp", "colo", "zero1", "zero2", "zero2+sync", "fsdp1", "fsdp2", "zero3-cuda",
    "zero3-cuda+telemetry", "zero3-cpu", "zero2-rs", "zero3-cuda-rs", "zero2-ar",
]  # fmt: skip
# Blocks of RESULTS.md that other benchmarks write (between these markers, "name:begin" or
# "name: begin") survive a rewrite.
KEPT_BLOCK = re.compile(r"<!-- (?P<name>[\w-]+): ?begin -->.*?<!-- (?P=name): ?end -->\n?", re.S)
SIZES = {
    "small": ["--n-layer", "2", "--n-embd", "128"],
    "medium": ["--n-layer", "4", "--n-embd", "256"],
    "large": ["--n-layer", "6", "--n-embd", "384"],
}


class Runner:
    """Runs the benchmark scripts (under torchrun where they are distributed) and remembers
    the commands for RESULTS.md."""

    def __init__(self, scratch: str) -> None:
        self.scratch = scratch
        self.commands: list[str] = []
        self.count = 0

    def _out(self) -> str:
        self.count += 1
        return f"{self.scratch}/run{self.count}.json"

    def ab(self, engines: list[str], flags: list[str], world: int) -> dict[str, Any]:
        out = self._out()
        self._run(
            [*_torchrun(world), str(HERE / "bench_ab.py"), "--engines", ",".join(engines),
             "--out", out, *flags]
        )  # fmt: skip
        return _load(out)

    def alone(self, engine: str, flags: list[str], world: int) -> dict[str, Any]:
        out = self._out()
        self._run(
            [*_torchrun(world), str(HERE / "bench_step.py"), "--engine", engine, "--out", out,
             *flags]
        )  # fmt: skip
        return _load(out)

    def collectives(self, numel: int, world: int) -> dict[str, Any]:
        out = self._out()
        self._run(
            [*_torchrun(world), str(HERE / "bench_collectives.py"), "--numel", str(numel),
             "--out", out]
        )  # fmt: skip
        return _load(out)

    def adam(self, numel: int) -> dict[str, Any]:
        out = self._out()
        self._run(
            [sys.executable, str(HERE / "bench_adam.py"), "--numel", str(numel), "--out", out]
        )
        return _load(out)

    def _run(self, command: list[str]) -> None:
        shown = ["python", *command[1:]]
        shown[shown.index("--out") + 1] = "OUT.json"
        line = shlex.join(shown).replace(str(HERE.parent) + "/", "")
        if line not in self.commands:
            self.commands.append(line)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=1800, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"{line} failed:\n{result.stderr[-4000:]}")


def _torchrun(world: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}",
    ]  # fmt: skip


def _load(path: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(Path(path).read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small models, few steps (a smoke run)"
    )
    parser.add_argument("--rounds", type=int, default=16, help="turns per engine in bench_ab")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    shape = ["--vocab", "8192", "--seq", "128"]
    alone_steps = ["--warmup", "3", "--steps", "10"]
    sizes = dict(SIZES)
    adam_numel = 50_000_000
    rounds = args.rounds
    if args.quick:
        shape = ["--vocab", "512", "--seq", "32"]
        alone_steps = ["--warmup", "1", "--steps", "3"]
        sizes = {
            "small": ["--n-layer", "1", "--n-embd", "32"],
            "medium": ["--n-layer", "2", "--n-embd", "64"],
            "large": ["--n-layer", "2", "--n-embd", "96"],
        }
        adam_numel = 1_000_000
        rounds = min(rounds, 2)
    model = sizes["medium"] + shape
    ab_flags = ["--rounds", str(rounds)]
    with tempfile.TemporaryDirectory() as scratch:
        runner = Runner(scratch)
        ab: dict[str, dict[str, Any]] = {}
        for group, engines in AB_GROUPS.items():
            print(f"interleaved step times, {group}: {', '.join(engines)}", flush=True)
            ab[group] = runner.ab(engines, model + ab_flags, args.world)
        alone: dict[str, dict[str, Any]] = {}
        for engine in ALONE_ENGINES:
            print(f"alone: {engine}", flush=True)
            alone[engine] = runner.alone(engine, model + alone_steps, args.world)
        print("profiles", flush=True)
        profiles = {
            engine: runner.alone(engine, ["--profile", *model, *alone_steps], args.world)
            for engine in ("zero2", "zero3-cuda")
        }
        scaling_size: dict[str, dict[str, Any]] = {}
        for name, size in sizes.items():
            print(f"size {name}", flush=True)
            scaling_size[name] = runner.ab(["fsdp2", "zero3-cuda"], size + shape + ab_flags, 2)
        scaling_world: dict[int, dict[str, Any]] = {}
        for world in (1, 2, 4):
            print(f"ranks {world}", flush=True)
            scaling_world[world] = runner.alone("zero3-cuda", model + alone_steps, world)
        print("collectives", flush=True)
        collectives = runner.collectives(int(ab["stage 2"]["params"]), args.world)
        print("HybridAdam vs torch fused AdamW", flush=True)
        adam = runner.adam(adam_numel)
    report = render(
        ab=ab,
        alone=alone,
        profiles=profiles,
        scaling_size=scaling_size,
        scaling_world=scaling_world,
        collectives=collectives,
        adam=adam,
        commands=runner.commands,
        invocation=f"python benchmarks/suite.py{' --quick' if args.quick else ''} "
        f"--rounds {args.rounds}",
        model_args=model,
    )
    out = Path(args.out)
    previous = out.read_text() if out.exists() else ""
    kept = "".join("\n" + match.group(0) for match in KEPT_BLOCK.finditer(previous))
    out.write_text(report + kept)
    print(f"wrote {args.out}")
    if not args.quick and out.resolve() == (HERE / "RESULTS.md").resolve():
        # These write their own blocks of RESULTS.md (kept above on the next run).
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for script in ("bench_auto.py", "bench_hybrid.py"):
            print(script, flush=True)
            subprocess.run([sys.executable, str(HERE / script)], env=env, timeout=1800, check=True)
        print("bench_checkpoint.py", flush=True)
        with tempfile.TemporaryDirectory() as scratch:
            checkpoints = [
                *_torchrun(2), str(HERE / "bench_checkpoint.py"), "--size", "117m",
                "--out", f"{scratch}/checkpoint.json", "--results", str(out),
            ]  # fmt: skip
            subprocess.run(checkpoints, env=env, timeout=1800, check=True)


if __name__ == "__main__":
    main()
