"""Hugging Face Llamas on one GPU under shardwise, torch FSDP2 and plain torch, bf16 compute:
the figures of the bigger-than-the-GPU issue.

    python benchmarks/bench_gpu.py llama --model 10.8b --engines shardwise-auto \\
        --checkpointing --warmup 1 --steps 2 --timeouts 150 --out llama-10.8b-ckpt.json
    python benchmarks/bench_gpu.py llama --model 2.7b \\
        --engines fsdp2-offload,shardwise-cpu,torch --timeouts 35,45,25 --out offload-2.7b.json
    python benchmarks/bench_gpu.py llama --smoke --engines shardwise-cpu,torch --out s.json

The model: `LlamaForCausalLM(LlamaConfig(...))`, `--model` 10.8b (width 4096, 52 layers:
10,786,082,816 parameters), 2.7b (width 2560, 32 layers: 2,695,772,160), smoke (64, 2) or
WIDTHxLAYERS; heads of 128, the MLP 8/3 of the width rounded up to 256 (Llama's rule: 11008
at 4096), vocabulary `--vocab`, untied head, `use_cache=False`; `--checkpointing` calls
`model.gradient_checkpointing_enable()` (HF's defaults) before the wrap. Each step trains on
`--batch` x `--seq` random tokens (8 x 1024), the labels the inputs (HF's shifted loss).

Engines (`--engines`), each attempt in a process of its own (bench_gpu.attempt: a timeout per
attempt, `--timeouts`, and a watchdog that stops it before the host runs out of memory), so an
out-of-memory error, the OOM killer or a hang ends that attempt only:
  shardwise-auto, -cpu, -cuda  built on the meta device; `zero_model_wrapper(model, 3,
      {"placement_policy": P, "param_init_fn": model._init_weights, "mixed_precision":
      MixedPrecision(param_dtype=torch.bfloat16)})`: each module gets storage and HF's own
      initialisation as the chunks take it (see [Note: meta-device models] in
      shardwise/prepare/meta_init.py), so the model is never whole anywhere; HybridAdam through
      `zero_optim_wrapper`; everything else at its default. `+disk` (e.g. shardwise-cpu+disk):
      HybridAdam(nvme_offload_fraction=--disk-fraction, nvme_offload_dir=--disk-dir), the disk
      tier; `+early` (e.g. shardwise-cpu+early): `step_in_backward=True`, each chunk's host
      step during backward (see [Note: the optimizer steps during backward] in
      shardwise/engine/backward_step.py). Both may be given (shardwise-cpu+disk+early).
  fsdp2-offload  built on the device (HF's initialisation there), `fully_shard` per decoder
      layer and the root with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) and
      CPUOffloadPolicy() (shards, gradients and the optimizer step on the host; unpinned
      without CUDA), torch's AdamW with fused=True; `fsdp2`: the same without offload.
  torch  built on the device in fp32, bf16 autocast, AdamW(fused=True).

Per attempt: build and wrap seconds, each step's milliseconds (the first `--warmup` apart from
the median of the rest), tokens/s, TFLOP/s and MFU by the 6N count (6 x parameters x tokens a
step, checkpointing's recomputation not counted, over the device's dense bf16 peak), the host
resident peak (`VmHWM`) beside the highest `VmRSS` sampled every 0.1 s in a thread (and a trace
each second) and the resident set before the model (torch, CUDA's context),
`torch.cuda.max_memory_allocated`, the planner's host and device figures for shardwise's
placement (`shardwise.planner.plan`, the engine's default budget), and whether it finished. An
attempt rewrites its record after each phase, so one stopped at its timeout or killed still
says how far it came. Ratios: each engine's later-step median over `--reference`'s (default:
the first engine listed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_gpu import PEAK_BF16, attempt, host_memory_bytes, session_facts

GIB = 2**30
SHAPES = {"10.8b": (4096, 52), "2.7b": (2560, 32), "smoke": (64, 2)}
PLACEMENTS = ("auto", "cpu", "cuda")
ENGINES = (
    *(f"shardwise-{p}" for p in PLACEMENTS),
    *(f"shardwise-{p}+disk" for p in PLACEMENTS),
    *(f"shardwise-{p}+early" for p in PLACEMENTS),
    *(f"shardwise-{p}+disk+early" for p in PLACEMENTS),
    *("fsdp2-offload", "fsdp2", "torch"),
)
Step = Callable[[torch.Tensor], torch.Tensor]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", nargs="?", default="run", choices=["run", "once"])
    parser.add_argument("--out", required=True, help="the JSON (run: every attempt's)")
    parser.add_argument("--engines", default="shardwise-auto", help="comma-separated (run)")
    parser.add_argument("--engine", help="the one engine of `once`")
    parser.add_argument("--model", default="10.8b", help="10.8b, 2.7b, smoke or WIDTHxLAYERS")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the timed ones")
    parser.add_argument("--steps", type=int, default=2, help="timed steps")
    parser.add_argument("--timeouts", default="300", help="seconds per attempt, one or per engine")
    parser.add_argument("--budget", type=float, help="seconds for all attempts (run)")
    parser.add_argument("--reference", help="the engine the ratios divide by (default: first)")
    parser.add_argument("--device-budget-gib", type=float, help="shardwise's device budget")
    parser.add_argument("--chunk-numel", type=int, help="shardwise's chunk size (default: its own)")
    parser.add_argument("--disk-dir", default="/tmp/shardwise-disk", help="+disk engines")
    parser.add_argument(
        "--disk-fraction", type=float, default=1.0,
        help="+disk engines: HybridAdam's nvme_offload_fraction (the disk tier keeps two slots "
        "of 12 bytes a parameter: 24 B/param at 1.0)",
    )  # fmt: skip
    parser.add_argument("--limit-gib", type=float, help="host watchdog (default: memory - 8 GiB)")
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama, any machine")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.vocab, args.batch, args.seq = "smoke", 512, 2, 64
        if not torch.cuda.is_available() and args.device_budget_gib is None:
            args.device_budget_gib = 1.0  # "auto" needs a budget on a CPU
    for engine in args.engines.split(",") + ([args.engine] if args.engine else []):
        if engine not in ENGINES:
            parser.error(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")
    return args


def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    width, layers = SHAPES.get(args.model) or (int(n) for n in args.model.split("x"))
    heads = width // 128 if width >= 256 else 4
    return LlamaConfig(
        hidden_size=width, intermediate_size=256 * math.ceil(8 * width / 3 / 256),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        vocab_size=args.vocab, max_position_embeddings=args.seq, tie_word_embeddings=False,
        use_cache=False,
    )  # fmt: skip


# ---- one attempt, in its own process -----------------------------------------------------------


def _status_gib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    return 0.0


class HostMemory:
    """This process's resident set: `VmHWM`, and `VmRSS` sampled every 0.1 s in a thread (the
    highest seen, and a trace of one sample a second)."""

    def __init__(self) -> None:
        self.highest = 0.0
        self.trace: list[list[float]] = []
        self._started = time.perf_counter()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        last = -1.0
        while True:
            resident = _status_gib("VmRSS")
            self.highest = max(self.highest, resident)
            now = time.perf_counter() - self._started
            if now - last >= 1.0:
                self.trace.append([round(now, 1), round(resident, 2)])
                last = now
            time.sleep(0.1)

    def figures(self) -> dict[str, Any]:
        return {
            "host_hwm_gib": round(_status_gib("VmHWM"), 2),
            "host_rss_sampled_max_gib": round(self.highest, 2),
            "host_rss_trace": self.trace,
        }


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def build_model(engine: str, config: Any, checkpointing: bool) -> torch.nn.Module:
    """shardwise's on the meta device, the others' on the device (HF's initialisation there)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    where = torch.device("meta") if engine.startswith("shardwise") else device()
    with where:
        model = LlamaForCausalLM(config)
    if checkpointing:
        with warnings.catch_warnings():  # renamed activation_checkpointing_enable in 5.2x
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
    return model.train()


def wrap(engine: str, model: torch.nn.Module, args: argparse.Namespace) -> Step:
    dev = device()
    if engine.startswith("shardwise"):
        from shardwise import HybridAdam, MixedPrecision, zero_model_wrapper, zero_optim_wrapper

        placement, *options = engine.removeprefix("shardwise-").split("+")
        disk = "disk" in options
        config: dict[str, Any] = {
            "placement_policy": placement,
            "param_init_fn": model._init_weights,  # type: ignore[operator]
            "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16),
        }
        if args.device_budget_gib:
            config["device_budget_bytes"] = int(args.device_budget_gib * GIB)
        if args.chunk_numel:
            config["chunk_size_numel"] = args.chunk_numel
        wrapped = zero_model_wrapper(model, 3, config)
        tier = {"nvme_offload_fraction": args.disk_fraction, "nvme_offload_dir": args.disk_dir}
        tier = tier if disk else {}
        if disk:
            os.makedirs(args.disk_dir, exist_ok=True)
        optimizer = zero_optim_wrapper(
            wrapped,
            HybridAdam(model.parameters(), lr=1e-4, **tier),
            step_in_backward="early" in options,
        )

        def step(ids: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad()
            loss = wrapped(input_ids=ids, labels=ids).loss
            optimizer.backward(loss)
            optimizer.step()
            return loss  # type: ignore[no-any-return]

        return step
    if engine.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        mesh = init_device_mesh(dev.type, (1,))
        options = {
            "mesh": mesh,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            ),
            "offload_policy": CPUOffloadPolicy(pin_memory=dev.type == "cuda")
            if engine == "fsdp2-offload"
            else OffloadPolicy(),
        }
        for layer in model.model.layers:  # type: ignore[union-attr]
            fully_shard(layer, **options)
        fully_shard(model, **options)
    optimizer_ = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    autocast = engine == "torch"

    def plain_step(ids: torch.Tensor) -> torch.Tensor:
        optimizer_.zero_grad()
        context = torch.autocast(dev.type, torch.bfloat16) if autocast else contextlib.nullcontext()
        with context:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer_.step()
        return loss  # type: ignore[no-any-return]

    return plain_step


def estimated_activations(model: torch.nn.Module, args: argparse.Namespace) -> int:
    """The planner's estimate of one step's activations (shardwise.planner
    .estimate_token_activation_bytes: input_ids, labels and a 4-D attention mask), on a bf16
    copy of the meta-device model, as the step computes: nothing is allocated."""
    import copy

    from shardwise.planner import estimate_token_activation_bytes

    meta = copy.deepcopy(model).to(torch.bfloat16)
    estimate = estimate_token_activation_bytes(meta, batch_size=args.batch, seq_len=args.seq)
    return estimate.total_bytes


def planned(engine: str, model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """The planner's figures (GiB) for this placement at the engine's default budget."""
    from shardwise.planner import plan

    placement = engine.removeprefix("shardwise-").partition("+")[0]
    if args.device_budget_gib:
        budget = int(args.device_budget_gib * GIB)
    elif torch.cuda.is_available():  # the engine's default: the capacity less 10%
        budget = int(torch.cuda.get_device_properties(0).total_memory * 0.9)
    else:
        return {"skipped": "no device budget on a CPU"}
    try:
        activations = estimated_activations(model, args)
        answer = plan(
            model, world_size=1, device_memory_bytes=budget,
            host_memory_bytes=host_memory_bytes(), param_dtype=torch.bfloat16,
            optimizer="hybridadam", chunk_size_numel=args.chunk_numel,
            activation_bytes=activations,
        )  # fmt: skip
        option = next(o for o in answer.options if o.stage == 3 and o.placement == placement)
    except Exception as error:  # the planner is the engine's to change: report, go on
        return {"error": f"{type(error).__name__}: {error}"}
    return {
        "activation_bytes": activations,
        "device_state_bytes": int(option.device.total),
        "working_bytes": int(option.working_bytes),
        "host_bytes": int(option.host.total),
        "fits": option.fits,
        "chunk_size_numel": answer.chunk_size_numel,
    }


def once(args: argparse.Namespace) -> None:
    """One engine: build, wrap, warm-up and timed steps, the record rewritten after each."""
    from bench_gpu import init_single_rank

    memory = HostMemory()
    engine, dev = args.engine, device()
    config = llama_config(args)
    record: dict[str, Any] = {
        "engine": engine, "model": args.model, "width": config.hidden_size,
        "layers": config.num_hidden_layers, "checkpointing": args.checkpointing,
        "batch": args.batch, "seq": args.seq, "phase": "started", "finished": False,
        "step_ms": [], "losses": [],
    }  # fmt: skip
    if engine == "fsdp2-offload" and dev.type != "cuda":
        record["note"] = "no CUDA: CPUOffloadPolicy(pin_memory=False) on the CPU (wiring only)"

    def save(phase: str) -> None:
        if dev.type == "cuda":
            record["device_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            record["device_max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
        record.update(phase=phase, **memory.figures())
        partial = Path(args.out + ".partial")
        partial.write_text(json.dumps(record, indent=1))
        partial.replace(args.out)  # whole or not at all, for whoever reads it

    init_single_rank()
    torch.zeros(1, device=dev)  # the device's context: part of the resident set at the start
    record["host_rss_start_gib"] = round(_status_gib("VmRSS"), 2)
    started = time.perf_counter()
    model = build_model(engine, config, args.checkpointing)
    record["params"] = sum(p.numel() for p in model.parameters())
    record["build_s"] = round(time.perf_counter() - started, 2)
    if engine.startswith("shardwise"):
        record["planner"] = planned(engine, model, args)
    save("built")
    started = time.perf_counter()
    step = wrap(engine, model, args)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        record["device_after_wrap_gib"] = round(torch.cuda.memory_allocated() / GIB, 2)
        # The wrap's own peak (torch's allocator, from outside the engine): each chunk placed
        # as it closes keeps it near what stays on the device.
        record["device_wrap_peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    record["wrap_s"] = round(time.perf_counter() - started, 2)
    record["host_rss_after_wrap_gib"] = round(_status_gib("VmRSS"), 2)
    save("wrapped")
    print(f"{engine}: {record['params'] / 1e9:.2f}B built in {record['build_s']} s, wrapped in "
          f"{record['wrap_s']} s", file=sys.stderr, flush=True)  # fmt: skip
    for index in range(args.warmup + args.steps):
        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        loss = step(ids)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        record["step_ms"].append(round((time.perf_counter() - started) * 1000, 1))
        record["losses"].append(round(float(loss.detach()), 4))
        print(f"step {index + 1}: {record['step_ms'][-1]:.0f} ms", file=sys.stderr, flush=True)
        save(f"step {index + 1}")
    record.update(figures(record, args))
    record["finished"] = True
    save("finished")
    # Out at once: a teardown that hangs (NCCL, FSDP2) would cost the attempt its timeout.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def figures(record: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """First step, the later steps' median, throughput and MFU by the 6N count."""
    steps = record["step_ms"]
    later = steps[args.warmup :] or steps[-1:]
    median = statistics.median(later)
    tokens = args.batch * args.seq
    flops = 6 * record["params"] * tokens / (median / 1000)
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = next((value for key, value in PEAK_BF16.items() if key in name), None)
    return {
        "first_step_ms": steps[0],
        "later_median_ms": round(median, 1),
        "first_over_later": round(steps[0] / median, 2),
        "tokens_per_s": round(tokens / (median / 1000), 1),
        "tflops_6n": round(flops / 1e12, 2),
        "mfu_6n": round(flops / peak, 4) if peak else None,
    }


# ---- the attempts of one run -------------------------------------------------------------------


def _passed_on(args: argparse.Namespace) -> list[str]:
    """The options an attempt takes from the run's."""
    flags = [
        "--model", args.model, "--vocab", str(args.vocab), "--batch", str(args.batch),
        "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps),
        "--disk-dir", args.disk_dir, "--disk-fraction", str(args.disk_fraction),
    ]  # fmt: skip
    if args.checkpointing:
        flags.append("--checkpointing")
    if args.device_budget_gib:
        flags += ["--device-budget-gib", str(args.device_budget_gib)]
    if args.chunk_numel:
        flags += ["--chunk-numel", str(args.chunk_numel)]
    return flags


def run(args: argparse.Namespace) -> dict[str, Any]:
    engines = args.engines.split(",")
    timeouts = [float(t) for t in args.timeouts.split(",")]
    timeouts += timeouts[-1:] * (len(engines) - len(timeouts))
    reference = args.reference or engines[0]
    config = llama_config(args)
    out = Path(args.out)
    result: dict[str, Any] = {
        "kind": "llama", "label": out.stem, "model": args.model, "width": config.hidden_size,
        "layers": config.num_hidden_layers, "vocab": args.vocab,
        "checkpointing": args.checkpointing, "batch": args.batch, "seq": args.seq,
        "warmup": args.warmup, "steps": args.steps, "smoke": args.smoke,
        "reference": reference, "session": session_facts(), "attempts": {},
    }  # fmt: skip
    deadline = time.monotonic() + (args.budget or float("inf"))
    for engine, timeout in zip(engines, timeouts[: len(engines)], strict=True):
        left = deadline - time.monotonic()
        if left < 10:
            result["attempts"][engine] = {"outcome": "not run: the part's time was spent"}
            continue
        name = f"{out.stem}.{engine.replace('+', '-')}"
        record_path, log = out.with_name(name + ".json"), out.with_name(name + ".log")
        record_path.unlink(missing_ok=True)
        command = [
            sys.executable, __file__, "once", "--engine", engine, "--out", str(record_path),
            *_passed_on(args),
        ]  # fmt: skip
        print(f"== {engine}: at most {min(timeout, left):.0f} s", flush=True)
        stopped = None
        try:
            ran = attempt(command, min(timeout, left), log, args.limit_gib)
        except SystemExit as exit_:  # stopped from outside (see main): keep what it wrote
            stopped = exit_
            ran = {"outcome": "stopped with its run", "log_tail": log.read_text()[-1500:]}
        if "+disk" in engine:  # its files go with it (an attempt ends without cleaning up)
            shutil.rmtree(args.disk_dir, ignore_errors=True)
        record = json.loads(record_path.read_text()) if record_path.exists() else {}
        result["attempts"][engine] = {**record, **ran}
        phase, steps = record.get("phase", "none"), record.get("step_ms")
        print(f"== {engine}: {ran['outcome']} in {ran.get('seconds')} s, phase {phase}, "
              f"steps {steps}", flush=True)  # fmt: skip
        if ran["outcome"] != "ok":
            print(ran["log_tail"][-800:], flush=True)
        result["ratios"] = ratios(result["attempts"], reference)
        out.write_text(json.dumps(result, indent=1))
        if stopped:
            raise stopped
    return result


def ratios(attempts: dict[str, Any], reference: str) -> dict[str, float]:
    """Each finished engine's later-step median over the reference's."""
    base = attempts.get(reference, {}).get("later_median_ms")
    if not base:
        return {}
    return {
        engine: round(record["later_median_ms"] / base, 3)
        for engine, record in attempts.items()
        if record.get("later_median_ms")
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.part == "once":
        once(args)
        return
    # Stopped by `timeout` (SIGTERM), unwind so that `attempt` ends the attempt it runs.
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for engine, record in result["attempts"].items():
        print(f"{engine}: {record['outcome']}, first {record.get('first_step_ms')} ms, later "
              f"{record.get('later_median_ms')} ms, MFU {record.get('mfu_6n')}, host peak "
              f"{record.get('host_hwm_gib')} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
