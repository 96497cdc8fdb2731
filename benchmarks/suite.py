"""The benchmark suite: every engine on the same model and ranks, ratios taken in one run.

    python benchmarks/suite.py [--quick] [--rounds 2]      (./dev bench runs it)

Writes benchmarks/RESULTS.md. Engines run one after another, round after round (interleaved),
and each figure is the median over all rounds' measured steps: timings drift on these machines
between runs, while ratios taken inside one run hold.
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
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ENGINES = [
    ("ddp", "cuda"),
    ("zero1", "cuda"),
    ("zero2", "cuda"),
    ("fsdp2", "cuda"),
    ("zero3", "cuda"),
    ("zero3", "cpu"),
]


def run(command: list[str], timeout: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{result.stderr[-4000:]}")


def step_command(
    engine: str, placement: str, out: str, model_args: list[str], world: int
) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        str(HERE / "bench_step.py"), "--engine", engine, "--placement", placement, "--out", out,
        *model_args,
    ]  # fmt: skip


def machine() -> str:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    python = platform.python_version()
    return f"{cpu}, {os.cpu_count()} cores, Python {python}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps (a smoke run)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    if args.quick:
        model_args = ["--n-layer", "2", "--n-embd", "64", "--vocab", "512", "--seq", "32",
                      "--warmup", "1", "--steps", "3"]  # fmt: skip
        adam_numel = 1_000_000
    else:
        model_args = ["--n-layer", "4", "--n-embd", "256", "--vocab", "8192", "--seq", "128",
                      "--warmup", "3", "--steps", "10"]  # fmt: skip
        adam_numel = 50_000_000
    results: dict[str, list[dict[str, Any]]] = {}
    commands: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for engine, placement in ENGINES:
                out = f"{scratch}/{engine}-{placement}-{round_index}.json"
                command = step_command(engine, placement, out, model_args, args.world)
                if round_index == 0:
                    commands.append(
                        shlex.join(["python", *command[1:]]).replace(str(HERE.parent) + "/", "")
                    )
                print(f"round {round_index + 1}/{args.rounds}: {engine} ({placement})", flush=True)
                run(command, timeout=600)
                summary = json.loads(Path(out).read_text())
                results.setdefault(summary["engine"], []).append(summary)
        adam_out = f"{scratch}/adam.json"
        adam_command = [
            sys.executable,
            str(HERE / "bench_adam.py"),
            "--numel",
            str(adam_numel),
            "--out",
            adam_out,
        ]
        print("HybridAdam vs torch fused AdamW", flush=True)
        run(adam_command, timeout=600)
        adam = json.loads(Path(adam_out).read_text())
        commands.append(
            shlex.join(["python", *adam_command[1:-2]]).replace(str(HERE.parent) + "/", "")
        )
    Path(args.out).write_text(render(results, adam, commands, args, model_args))
    print(f"wrote {args.out}")


def _shown(command: list[str]) -> str:
    """The command as a user types it from the repository root (scratch paths elided)."""
    shown = ["python", *command[1:]]
    if "--out" in shown:
        shown[shown.index("--out") + 1] = "OUT.json"
    return shlex.join(shown).replace(str(HERE.parent) + "/", "")


def median_ms(runs: list[dict[str, Any]]) -> float:
    return statistics.median(ms for run_ in runs for ms in run_["step_ms"])


def render(
    results: dict[str, list[dict[str, Any]]],
    adam: dict[str, Any],
    commands: list[str],
    args: argparse.Namespace,
    model_args: list[str],
) -> str:
    world = args.world
    params = next(iter(results.values()))[0]["params"]
    ms = {engine: median_ms(runs) for engine, runs in results.items()}
    lines = [
        "# Benchmark results",
        "",
        f"Written by `python benchmarks/suite.py{' --quick' if args.quick else ''} "
        f"--rounds {args.rounds}` on {datetime.date.today().isoformat()}: {machine()}, gloo, "
        f"{world} ranks, fp32 compute,",
        f"GPT with {params:,} parameters ({' '.join(model_args)}), global batch 8, AdamW (fused).",
        "Medians over all measured steps of all rounds; the engines ran interleaved, round after",
        "round, so each ratio compares figures taken in the same run.",
        "",
        "## Step time",
        "",
        "| engine | median ms/step | final loss | bytes sent/step/rank "
        "| model-state bytes/rank | peak RSS MiB/rank |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for engine, runs in results.items():
        last = runs[-1]
        sent = last["sent_bytes_per_step"]
        state = last["model_state_bytes"]
        lines.append(
            f"| {engine} | {ms[engine]:.1f} | {last['final_loss']:.4f} | "
            f"{f'{sent:,.0f}' if sent else 'n/a'} | {f'{state:,}' if state else 'n/a'} | "
            f"{last['peak_rss_mib']:.0f} |"
        )
    theory = {"zero1": 2, "zero2": 2, "zero3-cuda": 3, "zero3-cpu": 3}
    formula = {
        "zero1": 8 * params + 8 * params / world,
        "zero2": 4 * params + 12 * params / world,
        "zero3-cuda": 16 * params / world,
        "zero3-cpu": 16 * params / world,
    }
    lines += [
        "",
        "## Ratios (same run)",
        "",
        "| ratio | value | target |",
        "| --- | ---: | ---: |",
        f"| zero2 / ddp step time | {ms['zero2'] / ms['ddp']:.3f} | <= 1.00 |",
        f"| zero3 (cuda placement) / fsdp2 step time | {ms['zero3-cuda'] / ms['fsdp2']:.3f} "
        "| <= 0.90 |",
        f"| zero3 (cpu placement) / fsdp2 step time | {ms['zero3-cpu'] / ms['fsdp2']:.3f} | |",
        f"| zero1 / ddp step time | {ms['zero1'] / ms['ddp']:.3f} | |",
    ]
    for engine, multiple in theory.items():
        sent = results[engine][-1]["sent_bytes_per_step"]
        ratio = sent / (multiple * params * 4 * (world - 1) / world)
        lines.append(
            f"| {engine} bytes sent / ZeRO theory ({multiple} psi) | {ratio:.4f} | <= 1.02 |"
        )
    for engine, value in formula.items():
        state = results[engine][-1]["model_state_bytes"]
        lines.append(
            f"| {engine} model-state bytes / ZeRO formula | {state / value:.4f} | <= 1.03 |"
        )
    lines += [
        f"| HybridAdam / torch fused AdamW ({adam['numel']:,} elements, {adam['threads']} "
        f"threads) | {adam['hybrid_adam_ms'] / adam['fused_adamw_ms']:.3f} | <= 1.05 |",
        "",
        f"HybridAdam: {adam['hybrid_adam_ms']:.1f} ms/step ({adam['hybrid_gb_per_s']:.1f} GB/s "
        f"counting 7 x 4 bytes per element); torch fused AdamW: {adam['fused_adamw_ms']:.1f} "
        f"ms/step; results identical: {adam['identical']}.",
        "",
        "Stage 1 keeps, beside the whole local gradient, the reduced fp32 slice the optimizer",
        "reads, so its model state is the ZeRO formula plus 4 psi / N.",
        "",
        "## Commands",
        "",
        "```",
        *commands,
        "```",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
