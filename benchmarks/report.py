"""RESULTS.md from the suite's measurements (see suite.py for how each was taken)."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

# (interleaved group, numerator, denominator, target or "") for the step-time ratios.
STEP_RATIOS = [
    ("stage 2", "zero2", "ddp", "<= 1.00"),
    ("stage 2", "zero2+sync", "ddp", ""),
    ("stage 3", "zero3-cuda", "fsdp2", "<= 0.90"),
    ("stage 3", "zero3-cpu", "fsdp2", ""),
    ("stage 3", "zero3-cuda+defaults", "fsdp2", ""),
    ("stage 3", "zero3-cuda", "fsdp1", ""),
    ("variants", "colo", "ddp", ""),
    ("variants", "zero1", "ddp", ""),
    ("variants", "zero2-rs", "ddp", ""),
    ("variants", "zero2-ar", "ddp", ""),
    ("variants", "zero3-cuda-rs", "fsdp2", ""),
]
# Engine -> multiple of psi its gradients and parameters should send per step (ZeRO analysis);
# by design the all-reduce run sends one psi more, and so does stage 1, whose all-reduce leaves
# the averaged gradient in `.grad` as DDP does.
TRAFFIC = {
    "zero1": 3, "zero2": 2, "zero2+sync": 2, "zero3-cuda": 3, "zero3-cpu": 3, "zero2-rs": 2,
    "zero3-cuda-rs": 3, "zero2-ar": 3,
}  # fmt: skip


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


def _ratio_row(group: str, engines: dict[str, Any], top: str, bottom: str, target: str) -> str:
    ratio = engines[top]["median_ms"] / engines[bottom]["median_ms"]
    rounds = [
        a / b
        for a, b in zip(
            engines[top]["round_median_ms"], engines[bottom]["round_median_ms"], strict=True
        )
    ]
    spread = f"{min(rounds):.3f} to {max(rounds):.3f}"
    limit = float(target.split()[-1]) if target else None
    met = f"{sum(r <= limit for r in rounds)}/{len(rounds)}" if limit is not None else ""
    return f"| {top} / {bottom} ({group}) | {ratio:.3f} | {spread} | {met} | {target} |"


def render(
    *,
    ab: dict[str, dict[str, Any]],
    alone: dict[str, dict[str, Any]],
    profiles: dict[str, dict[str, Any]],
    scaling_size: dict[str, dict[str, Any]],
    scaling_world: dict[int, dict[str, Any]],
    collectives: dict[str, Any],
    adam: dict[str, Any],
    commands: list[str],
    invocation: str,
    model_args: list[str],
) -> str:
    first = next(iter(ab.values()))
    world, params = first["world"], first["params"]
    lines = [
        "# Benchmark results",
        "",
        f"Written by `{invocation}` on {datetime.date.today().isoformat()}: {machine()}, gloo, "
        f"{world} ranks, fp32 compute, GPT with {params:,} parameters "
        f"({' '.join(model_args)}), global batch 8, AdamW (fused). No GPU was used.",
        "",
        "## Step time (engines interleaved in one process group)",
        "",
        "Each group of engines runs in one process group, every engine training its own copy",
        "of the model (same seed, same batches). They take turns of 3 steps, the order",
        "rotating each round; the first step of each turn is not counted (it refills the",
        "caches the previous engine used). Separate runs of one engine drift by several",
        "percent here; turns this short share the drift, so the ratios hold. The per-round",
        "range shows how far one round's ratio (2 steps per engine) strays from the median.",
        "",
        "| group | engine | steps | median ms/step | final loss |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for group, run in ab.items():
        for name, engine in run["engines"].items():
            lines.append(
                f"| {group} | {name} | {run['steps_per_engine']} | {engine['median_ms']:.1f} "
                f"| {engine['final_loss']:.6f} |"
            )
    identical = all(
        len({e["final_loss"] for e in run["engines"].values()}) == 1 for run in ab.values()
    )
    lines += [
        "",
        "Final losses are identical within each group: the engines trained the same model the "
        "same way."
        if identical
        else "Final losses differ within a group: see the table.",
        "",
        "| ratio (group) | median | per-round range | rounds at target | target |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        _ratio_row(group, ab[group]["engines"], top, bottom, target)
        for group, top, bottom, target in STEP_RATIOS
    ]
    lines += _alone_section(alone, profiles, adam, params, world)
    lines += _collectives_section(collectives)
    lines += _scaling_section(scaling_size, scaling_world)
    lines += ["", "## Commands", "", "```", *commands, "```", ""]
    return "\n".join(lines)


def _alone_section(
    alone: dict[str, dict[str, Any]],
    profiles: dict[str, dict[str, Any]],
    adam: dict[str, Any],
    params: int,
    world: int,
) -> list[str]:
    lines = [
        "",
        "## Traffic, memory and overheads (each engine in a run of its own)",
        "",
        "| engine | ms/step alone | bytes sent/step/rank | model-state bytes/rank "
        "| peak RSS MiB/rank |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for engine, run in alone.items():
        sent, state = run["sent_bytes_per_step"], run["model_state_bytes"]
        lines.append(
            f"| {engine} | {run['median_ms']:.1f} | {f'{sent:,.0f}' if sent else 'n/a'} | "
            f"{f'{state:,}' if state else 'n/a'} | {run['peak_rss_mib']:.0f} |"
        )
    formula = {
        "zero1": 8 * params + 8 * params / world,
        "zero2": 4 * params + 12 * params / world,
        "zero3-cuda": 16 * params / world,
        "zero3-cpu": 16 * params / world,
    }
    telemetry_cpu = alone["zero3-cuda+telemetry"]["telemetry_cpu_ms_per_step"]
    telemetry_share = telemetry_cpu / alone["zero3-cuda"]["median_ms"]
    lines += ["", "| ratio | value | target |", "| --- | ---: | ---: |"]
    for engine, multiple in TRAFFIC.items():
        ratio = alone[engine]["sent_bytes_per_step"] / (multiple * params * 4 * (world - 1) / world)
        target = "<= 1.02"
        if engine.endswith("-ar") or engine == "zero1":
            target = "all-reduce: by design"
        lines.append(f"| {engine} bytes sent / {multiple} psi | {ratio:.4f} | {target} |")
    for engine, value in formula.items():
        ratio = alone[engine]["model_state_bytes"] / value
        lines.append(f"| {engine} model-state bytes / ZeRO formula | {ratio:.4f} | <= 1.03 |")
    for engine, profile in profiles.items():
        share = profile["shardwise_python_share"]
        lines.append(
            f"| {engine}: time in shardwise's own Python code / step | {share:.3f} | <= 0.05 |"
        )
    lines += [
        f"| telemetry CPU (step hook + delivery thread) / zero3 step time "
        f"| {telemetry_share:.4f} | <= 0.02 |",
        f"| HybridAdam / torch fused AdamW ({adam['numel']:,} elements, {adam['threads']} "
        f"threads) | {adam['hybrid_adam_ms'] / adam['fused_adamw_ms']:.3f} | <= 1.05 |",
        "",
        f"HybridAdam: {adam['hybrid_adam_ms']:.1f} ms/step ({adam['hybrid_gb_per_s']:.1f} GB/s "
        f"counting 7 x 4 bytes per element); torch fused AdamW: {adam['fused_adamw_ms']:.1f} "
        f"ms/step; results identical: {adam['identical']}.",
        "",
        "Stage 3 sends less than 3 psi: the chunks backward starts with (here the tied",
        "embedding and head) stay gathered from the end of forward, so they are gathered once",
        "per step, not twice. Stage 1 all-reduces the gradients in backward, so `.grad` holds",
        "DDP's average, and the optimizer reads its fp32 slice of that; it keeps the slice in",
        "this rank's own part of the whole gradient, so it holds the ZeRO formula too.",
        "The Python share is cProfile's own time in shardwise functions (hooks, chunk",
        "bookkeeping, the optimizer wrapper; torch calls excluded) over the profiled steps'",
        f"wall time. Telemetry took {telemetry_cpu:.2f} ms of CPU per step (its step hook on",
        "the training thread plus its delivery thread, which compete with training for these",
        "cores).",
        "",
        "Stage 2 against DDP: ZeRO-2 replaces DDP's one all-reduce by a reduce-scatter",
        "(overlapped with backward, as DDP overlaps its all-reduce) and an all-gather of the",
        "updated parameters after the step, which nothing can overlap unless the next forward",
        "runs while it completes: by default (`zero2`) each module waits for its own chunks in",
        "the next forward (a parameter read before it waits too); `zero2+sync`",
        "(`optim_config={'overlap_param_gather': False}`) waits for them in the step.",
    ]
    return lines


def _collectives_section(timings: dict[str, Any]) -> list[str]:
    """Why gradients are reduce-scattered with an all-to-all on gloo."""
    numel = timings["numel"]
    native, a2a = timings["reduce_scatter_ms"], timings["all_to_all_reduce_scatter_ms"]
    return [
        "",
        f"## gloo's collectives at the model's size ({numel:,} fp32 elements, "
        f"{timings['world']} ranks)",
        "",
        "| collective | ms |",
        "| --- | ---: |",
        f"| all_reduce | {timings['all_reduce_ms']:.1f} |",
        f"| reduce_scatter (gloo's) | {native:.1f} |",
        f"| reduce_scatter (all-to-all + local sum, shardwise on gloo) | {a2a:.1f} |",
        f"| all_gather | {timings['all_gather_ms']:.1f} |",
        "",
        f"A reduce-scatter sends half an all-reduce's bytes, yet gloo's own took "
        f"{native / timings['all_reduce_ms']:.1f} times as long as its all-reduce here;",
        f"the same reduce-scatter run as an all-to-all and a local sum took "
        f"{a2a / timings['all_reduce_ms']:.2f} times the all-reduce's time,",
        "which is how shardwise reduces gradients on gloo (`gradient_reduction=\"auto\"`; the",
        "`-rs` rows force gloo's reduce-scatter, the `-ar` row an all-reduce).",
    ]  # fmt: skip


def _scaling_section(
    scaling_size: dict[str, dict[str, Any]], scaling_world: dict[int, dict[str, Any]]
) -> list[str]:
    lines = [
        "",
        "## Scaling with model size (fsdp2 and zero3 interleaved, per size)",
        "",
        "| size | parameters | fsdp2 ms/step | zero3 ms/step | zero3 / fsdp2 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, run in scaling_size.items():
        fsdp2 = run["engines"]["fsdp2"]["median_ms"]
        zero3 = run["engines"]["zero3-cuda"]["median_ms"]
        lines.append(
            f"| {name} | {run['params']:,} | {fsdp2:.1f} | {zero3:.1f} | {zero3 / fsdp2:.3f} |"
        )
    lines += [
        "",
        "## Scaling with ranks (zero3, same global batch; 4 ranks share 2 cores)",
        "",
        "| ranks | ms/step | bytes sent/step/rank |",
        "| ---: | ---: | ---: |",
    ]
    for ranks, result in scaling_world.items():
        sent = result["sent_bytes_per_step"]
        median = statistics.median(result["step_ms"])
        lines.append(f"| {ranks} | {median:.1f} | {f'{sent:,.0f}' if sent else 0} |")
    return lines
