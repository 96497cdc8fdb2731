"""One GPU session's results as a block of benchmarks/RESULTS.md, from the files it left.

    python benchmarks/bench_gpu.py report OUT --command "bash benchmarks/gpu_session.sh all OUT"

Reads OUT's JSON files (bench_gpu.py bounds: `"kind": "bounds"`; bench_gpu.py llama: `"kind":
"llama"`, in the order they were written), `parts.tsv` (gpu_session.sh: each part's exit code,
seconds and budget) and `gpu-tests.log` (pytest's summary line), and writes the block to
`--results` (default OUT/RESULTS-gpu.md) and stdout: the device, the versions, the commit and
the command, each part's outcome, the bounds, one table per llama run, and the targets of the
bigger-than-the-GPU issue, each met, not met or not measured. The session pastes the block into
RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

GIB = 2**30


def load(out: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The bounds record and the llama runs of `out`, oldest first."""
    bounds, runs = None, []
    for path in sorted(out.glob("*.json"), key=lambda p: p.stat().st_mtime):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        if data.get("kind") == "bounds":
            bounds = data
        elif data.get("kind") == "llama":
            runs.append(data)
    return bounds, runs


def header(session: dict[str, Any], command: str, out: Path) -> list[str]:
    device = session.get("device", "no device")
    memory = session.get("device_memory_gib")
    lines = [
        "## GPU: bigger than the GPU",
        "",
        f"{device}{f' ({memory:.0f} GiB)' if memory else ''}, {session.get('cores')} cores, "
        f"{session.get('host_memory_gib')} GiB of host memory; torch {session.get('torch')} "
        f"(CUDA {session.get('cuda')}), transformers {session.get('transformers', 'absent')}, "
        f"Python {session.get('python')}; shardwise at {session.get('commit')}; "
        f"{session.get('date')}. One call:",
        "",
        f"    {command}",
        "",
    ]
    parts = out / "parts.tsv"
    if parts.exists():
        lines += ["| part | exit | seconds (budget) |", "| --- | --- | ---: |"]
        for row in parts.read_text().splitlines():
            name, code, seconds, budget = [*row.split("\t"), "", "", ""][:4]
            outcome = {"0": "0", "124": "124 (stopped at its budget)"}.get(code, code)
            lines.append(f"| {name} | {outcome} | {seconds} ({budget}) |")
        lines.append("")
    tests = out / "gpu-tests.log"
    if tests.exists():
        summary = [
            ln
            for ln in tests.read_text().splitlines()
            if re.search(r"\d+ (passed|failed|skipped|error)", ln)
        ]
        lines += [f"tests/gpu: {summary[-1].strip('= ') if summary else 'no summary line'}.", ""]
    return lines


def bounds_lines(bounds: dict[str, Any], params: int) -> list[str]:
    lines = ["**What bounds an offloaded step** (`bench_gpu.py bounds`, medians):", ""]
    copies = bounds["copies"]
    if "skipped" in copies:
        lines += [f"Copies: skipped ({copies['skipped']}).", ""]
        both = None
    else:
        lines += [
            "| MiB a copy | pinned h->d | pinned d->h | pinned, both at once (each way) "
            "| pageable h->d | pageable d->h |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in copies["sizes"]:
            lines.append(
                f"| {row['mib']} | {row['pinned_h2d_gbps']} | {row['pinned_d2h_gbps']} | "
                f"{row['pinned_both_each_gbps']} | {row['pageable_h2d_gbps']} | "
                f"{row['pageable_d2h_gbps']} |"
            )
        lines += ["", "(GB/s, 10^9 bytes a second.)", ""]
        both = copies["sizes"][-1]["pinned_both_each_gbps"]
    adam, host = bounds["adam"], bounds["host_copy"]
    hybrid, fused = adam["hybrid_adam"], adam["adamw_fused"]
    lines += [
        f"Host optimizer, {adam['params']:,} fp32 parameters in {adam['tensors']} tensors on "
        f"{adam['threads']} threads: HybridAdam {hybrid['params_per_s'] / 1e9:.2f}G parameters/s "
        f"({hybrid['step_s']} s a step), torch AdamW(fused=True) "
        f"{fused['params_per_s'] / 1e9:.2f}G/s ({fused['step_s']} s). Host memory: `copy_` of "
        f"{host['mib']} MiB on {host['threads']} threads {host['copy_gbps']} GB/s "
        f"({host['read_write_gbps']} GB/s read and written).",
        "",
    ]
    floor = [f"HybridAdam over all of them {params / hybrid['params_per_s']:.2f} s"]
    if both:
        floor.append(
            f"their bf16 parameters up and bf16 gradients down, both at once, "
            f"{2 * params / (both * 1e9):.2f} s"
        )
    lines += [
        f"So a step of {params / 1e9:.1f}B parameters with every optimizer state on the host "
        f"takes at least the largest of: {'; '.join(floor)} (each can overlap the others and "
        f"the compute).",
        "",
    ]
    return lines


def _gib(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _seconds(ms: float | None) -> str:
    return "" if ms is None else f"{ms / 1000:.2f}"


def run_lines(run: dict[str, Any]) -> list[str]:
    params = next((a["params"] for a in run["attempts"].values() if a.get("params")), None)
    size = f"{params:,} parameters, " if params else ""
    lines = [
        f"**{run['label']}** (`bench_gpu.py llama`): LlamaForCausalLM of {size}width "
        f"{run['width']}, {run['layers']} layers, vocabulary {run['vocab']}; batch "
        f"{run['batch']} x {run['seq']} tokens; activation checkpointing "
        f"{'on' if run['checkpointing'] else 'off'}; {run['warmup']} warm-up then "
        f"{run['steps']} timed steps.",
        "",
        "| engine | outcome (phase reached) | wrap s | first step s | later step s | first / "
        "later | tokens/s | MFU (6N) | host peak GiB (VmHWM / sampled (at start)) | planner "
        f"host GiB | device peak GiB (of the wrap) | vs {run['reference']} | loss, first -> last |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for engine, a in run["attempts"].items():
        lines.append(_row(engine, a, (run.get("ratios") or {}).get(engine)))
    notes = [f"{e}: {a['note']}" for e, a in run["attempts"].items() if a.get("note")]
    unfinished = [
        f"{e} stopped after {a.get('step_ms') or 'no step'} ms" for e, a in run["attempts"].items()
        if not a.get("finished") and a.get("outcome") != "ok"
    ]  # fmt: skip
    lines.append("")
    if notes or unfinished:
        lines += ["; ".join(notes + unfinished) + ".", ""]
    return lines


def _row(engine: str, a: dict[str, Any], ratio: float | None) -> str:
    planned = (a.get("planner") or {}).get("host_bytes")
    tokens, mfu = a.get("tokens_per_s"), a.get("mfu_6n")
    hwm, sampled = a.get("host_hwm_gib"), a.get("host_rss_sampled_max_gib")
    losses = a.get("losses") or []
    cells = [
        engine,
        f"{a.get('outcome')} ({a.get('phase', 'none')})",
        str(a.get("wrap_s", "")),
        _seconds(a.get("first_step_ms")),
        _seconds(a.get("later_median_ms")),
        str(a.get("first_over_later", "")),
        "" if tokens is None else f"{tokens:,.0f}",
        "" if mfu is None else f"{mfu:.1%}",
        "" if hwm is None else f"{hwm:.1f} / {sampled:.1f} ({a.get('host_rss_start_gib')})",
        "" if planned is None else _gib(planned / GIB),
        _gib(a.get("device_max_allocated_gib"))
        + (f" ({_gib(a['device_wrap_peak_gib'])})" if a.get("device_wrap_peak_gib") else ""),
        "" if ratio is None else str(ratio),
        " -> ".join(str(loss) for loss in losses[:1] + losses[1:][-1:]),
    ]
    return "| " + " | ".join(cells) + " |"


def _finished(runs: list[dict[str, Any]], engine: str) -> list[tuple[dict, dict]]:
    return [
        (run, run["attempts"][engine])
        for run in runs
        if run["attempts"].get(engine, {}).get("finished")
    ]


def targets(runs: list[dict[str, Any]]) -> list[str]:
    """The issue's figures, each met, not met or not measured."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"

    lines = []
    main = [
        (run, a) for run, a in _finished(runs, "shardwise-auto")
        if run["checkpointing"] and (run["width"], run["layers"]) == (4096, 52)
    ]  # fmt: skip
    if main:
        _, a = main[0]
        later, first = a["later_median_ms"], a["first_step_ms"]
        lines.append(f"- 10.8B, checkpointing, \"auto\": later step {later / 1000:.2f} s <= 2.0 s "
                     f"(MFU {a['mfu_6n'] or 0:.1%} >= 27%): {verdict(later <= 2000)}")  # fmt: skip
        lines.append(f"- first step {first / 1000:.2f} s <= 2x a later one: "
                     f"{verdict(first <= 2 * later)}")  # fmt: skip
        planned = (a.get("planner") or {}).get("host_bytes")
        if planned:
            ratio = a["host_hwm_gib"] * GIB / planned
            lines.append(f"- host resident peak {a['host_hwm_gib']:.1f} GiB within 10% of the "
                         f"planner's host figure {planned / GIB:.1f} GiB ({ratio:.2f}x): "
                         f"{verdict(abs(ratio - 1) <= 0.1)}")  # fmt: skip
    else:
        lines.append('- 10.8B, checkpointing, "auto": not measured (no finished attempt)')
    plain = [
        (run, a) for run, a in _finished(runs, "shardwise-auto")
        if not run["checkpointing"] and (run["width"], run["layers"]) == (4096, 52)
    ]  # fmt: skip
    lines.append(
        f"- 10.8B without checkpointing trains: {'met' if plain else 'not met or not measured'}"
    )
    pair = ("shardwise-cpu", "fsdp2-offload")
    both = [run for run in runs if all(run["attempts"].get(e, {}).get("finished") for e in pair)]
    if both:
        a, b = (both[0]["attempts"][e]["later_median_ms"] for e in pair)
        lines.append(f"- \"cpu\" placement {a / 1000:.2f} s a step <= 0.8x FSDP2 "
                     f"CPUOffloadPolicy's {b / 1000:.2f} s ({a / b:.2f}x): "
                     f"{verdict(a <= 0.8 * b)}")  # fmt: skip
    else:
        lines.append('- "cpu" placement against FSDP2 CPUOffloadPolicy: not measured')
    for engine, goal in (("shardwise-auto", 16e9), ("shardwise-auto+disk", 18e9)):
        trained = [a["params"] for run, a in _finished(runs, engine) if run["checkpointing"]]
        if trained:
            lines.append(f"- largest under {engine}, checkpointing: {max(trained) / 1e9:.1f}B "
                         f">= {goal / 1e9:.0f}B: {verdict(max(trained) >= goal)}")  # fmt: skip
    return lines


def block(out: Path, command: str) -> list[str]:
    bounds, runs = load(out)
    session = (bounds or (runs[0] if runs else {})).get("session", {})
    smoke = bool((bounds or {}).get("smoke")) or any(run.get("smoke") for run in runs)
    lines = header(session, command, out)
    if smoke:
        lines += ["A smoke run: tiny sizes, the wiring only; no figure here means anything.", ""]
    if bounds:
        lines += bounds_lines(bounds, 10_786_082_816)
    for run in runs:
        lines += run_lines(run)
    lines += ['**Targets** (the issue\'s "Done when"):', "", *targets(runs)]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the session's folder of results")
    parser.add_argument("--command", default="bash benchmarks/gpu_session.sh all OUT")
    parser.add_argument("--results", type=Path, help="default: OUT/RESULTS-gpu.md")
    args = parser.parse_args(argv)
    text = "\n".join(block(args.out, args.command)) + "\n"
    (args.results or args.out / "RESULTS-gpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
