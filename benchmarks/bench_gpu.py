"""The GPU half of the suite: one CUDA device, bf16 compute with fp32 master weights.

    python benchmarks/bench_gpu.py compare --out compare.json
    python benchmarks/bench_gpu.py largest --placement cpu --layers 48,40,32 --out big.json
    python benchmarks/bench_gpu.py compare --smoke --out s.json     (tiny, any device)
    python benchmarks/bench_gpu.py bounds --out bounds.json         (bench_gpu_bounds.py)
    python benchmarks/bench_gpu.py llama --model 10.8b --engines shardwise-auto \
        --checkpointing --out llama.json                             (bench_gpu_llama.py)
    python benchmarks/bench_gpu.py report OUT                        (bench_gpu_report.py)

bounds, llama and report live in files of their own (each with its docstring): what bounds an
offloaded step, Hugging Face Llamas under shardwise, FSDP2 and plain torch, and the markdown
block of one session's results.

compare: the same GPT trained by plain torch (unsharded fp32 weights under bf16 autocast),
torch FSDP2 (fully_shard per block and root, bf16 parameters, fp32 reduction and master) and
shardwise stage 3 ("cuda" placement, bf16 payload, fp32 master), fused AdamW for all, in turns
of a few steps (as bench_ab.py); median step time, tokens/s, TFLOP/s and MFU per engine.

largest: for one placement ("auto" or "cpu"), GPTs of `--n-embd` width with each layer count of
`--layers` in turn (largest first), each in a process of its own so that running out of memory
ends only that attempt; stops at the first that trains `--steps` steps. `--placement torch`
tries plain torch the same way.

FLOPs per step are 6 x parameters x tokens plus attention's 12 x layers x width x sequence x
tokens (the usual estimate); MFU divides by the device's dense bf16 peak where it is known.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise import HybridAdam, MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import GPT, GPTConfig, gpt_batch

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Dense bf16 peaks (FLOP/s), by a substring of the device name.
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["compare", "largest", "once"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps")
    parser.add_argument("--engine", default="shardwise-cuda", help="for `once`")
    parser.add_argument("--placement", default="auto", choices=["auto", "cpu", "torch"])
    parser.add_argument("--layers", default="48,40,32,24,16,8", help="for `largest`")
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--n-embd", type=int, default=2048)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chunk-mib", type=float, default=64.0)
    parser.add_argument(
        "--device-budget-gib", type=float, default=None,
        help="\"auto\" placement's device budget (default: on CUDA, its capacity less 10%%)",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4, help="turns per engine in `compare`")
    parser.add_argument("--attempt-timeout", type=int, default=540, help="seconds, `largest`")
    args = parser.parse_args()
    if args.smoke:
        args.n_layer, args.n_embd, args.n_head, args.vocab, args.seq, args.batch = (
            2,
            64,
            4,
            512,
            64,
            4,
        )
        args.layers, args.chunk_mib, args.steps, args.rounds = "2,1", 0.25, 2, 2
        args.warmup = 1
        if not torch.cuda.is_available():
            args.device_budget_gib = 1.0  # "auto" needs one on a CPU
    return args


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def init_single_rank() -> None:
    """A one-rank process group (NCCL on a GPU), without a launcher."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def build(engine: str, config: GPTConfig, chunk_mib: float, budget_gib: float | None) -> Step:
    """One training step of `engine` over a fresh GPT (seed 0)."""
    dev = device()
    torch.manual_seed(0)
    if engine == "torch":
        model = GPT(config).to(dev)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return _torch_step(model, optimizer, autocast=True)
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = GPT(config).to(dev)
        mesh = init_device_mesh(dev.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return _torch_step(model, optimizer, autocast=False)
    placement = engine.removeprefix("shardwise-")
    # Offloaded runs go for the largest model: built on the meta device, each module gets its
    # storage and its values (GPT's own initialisation) only as the chunks take it, so no rank
    # ever holds the whole model (see [Note: meta-device models]).
    meta = placement != "cuda"
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GPT(config)
    wrapped = zero_model_wrapper(
        model,
        3,
        {
            "device": dev,
            "placement_policy": placement,
            "chunk_size_numel": int(chunk_mib * 2**20 / 2),
            "mixed_precision": MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            ),
            # None: on CUDA, the device's capacity less 10%.
            "device_budget_bytes": int(budget_gib * 2**30) if budget_gib else None,
            **({"param_init_fn": _gpt_init(model)} if meta else {}),
        },
    )
    inner = (
        torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        if placement == "cuda"
        else HybridAdam(model.parameters(), lr=1e-4)
    )
    optimizer = zero_optim_wrapper(wrapped, inner)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        _, loss = wrapped(idx, targets)
        optimizer.backward(loss)
        optimizer.step()
        return loss

    return step


def _gpt_init(model: GPT) -> Callable[[torch.nn.Module], None]:
    """GPT's initialisation of one module's own tensors, for `model` built on the meta device:
    GPT.__init__'s values, the residual projections scaled down with depth."""
    residual = {id(m) for block in model.blocks for m in (block.attn.proj, block.fc_proj)}
    residual_std = 0.02 / (2 * model.config.n_layer) ** 0.5

    def init(module: torch.nn.Module) -> None:
        if id(module) in residual:
            torch.nn.init.normal_(module.weight, std=residual_std)  # type: ignore[arg-type]
            if module.bias is not None:  # type: ignore[union-attr]
                torch.nn.init.zeros_(module.bias)  # type: ignore[arg-type]
        elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            GPT._init_weights(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()  # type: ignore[operator]

    return init


def _torch_step(model: GPT, optimizer: torch.optim.Optimizer, *, autocast: bool) -> Step:
    dev = device()

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        context = (
            torch.autocast(dev.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        )
        with context:
            _, loss = model(idx, targets)
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()
        return loss  # type: ignore[return-value]

    return step


def timed(
    step: Step, config: GPTConfig, args: argparse.Namespace, first: int, count: int
) -> list[float]:
    """Milliseconds of `count` steps starting at batch `first`, synchronised with the device."""
    dev, times = device(), []
    for i in range(first, first + count):
        idx, targets = gpt_batch(config, args.batch, args.seq, i)
        idx, targets = idx.to(dev), targets.to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(idx, targets)
        float(loss.detach())  # waits for the step
        times.append((time.perf_counter() - start) * 1000)
    return times


def throughput(
    config: GPTConfig, params: int, args: argparse.Namespace, ms: float
) -> dict[str, Any]:
    tokens = args.batch * args.seq
    flops = 6 * params * tokens + 12 * config.n_layer * config.n_embd * args.seq * tokens
    achieved = flops / (ms / 1000)
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = next((value for key, value in PEAK_BF16.items() if key in name), None)
    return {
        "median_ms": ms,
        "tokens_per_s": tokens / (ms / 1000),
        "tflops": achieved / 1e12,
        "mfu": achieved / peak if peak else None,
    }


def gpt_config(args: argparse.Namespace, n_layer: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=n_layer, n_head=args.n_head,
        n_embd=args.n_embd,
    )  # fmt: skip


def compare(args: argparse.Namespace) -> dict[str, Any]:
    config = gpt_config(args, args.n_layer)
    params = _count_params(config)
    engines = {
        name: build(name, config, args.chunk_mib, args.device_budget_gib)
        for name in ("torch", "fsdp2", "shardwise-cuda")
    }
    done = dict.fromkeys(engines, 0)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for name, step in engines.items():
        timed(step, config, args, 0, args.warmup)
        done[name] = args.warmup
    for round_index in range(args.rounds):
        names = list(engines)[round_index % 3 :] + list(engines)[: round_index % 3]
        for name in names:
            times[name] += timed(engines[name], config, args, done[name], args.steps)
            done[name] += args.steps
    results = {
        name: throughput(config, params, args, statistics.median(t)) for name, t in times.items()
    }
    return {"params": params, "engines": results, **_device_facts()}


def _count_params(config: GPTConfig) -> int:
    with torch.device("meta"):
        return GPT(config).num_parameters()


def once(args: argparse.Namespace) -> dict[str, Any]:
    config = gpt_config(args, args.n_layer)
    params = _count_params(config)
    started = time.perf_counter()
    step = build(args.engine, config, args.chunk_mib, args.device_budget_gib)
    # Progress on stderr: an attempt stopped at its timeout still shows how far it came.
    print(f"built {params / 1e9:.2f}B parameters in {time.perf_counter() - started:.1f} s",
          file=sys.stderr, flush=True)  # fmt: skip
    warmup = timed(step, config, args, 0, args.warmup)
    print(f"warm-up steps (ms): {[round(t) for t in warmup]}", file=sys.stderr, flush=True)
    ms = statistics.median(timed(step, config, args, args.warmup, args.steps))
    peak_gpu = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return {
        "engine": args.engine,
        "n_layer": args.n_layer,
        "params": params,
        "peak_gpu_gib": peak_gpu,
        "planner": _planned(args, config),
        **throughput(config, params, args, ms),
        **_device_facts(),
    }


def _planned(args: argparse.Namespace, config: GPTConfig) -> dict[str, Any] | None:
    """The planner's device and host bytes (GiB) for this engine, activations left out (the
    planner takes them as given), beside the measured peak."""
    if args.engine == "torch" or not (torch.cuda.is_available() or args.device_budget_gib):
        return None
    from shardwise.planner import plan

    with torch.device("meta"):
        model = GPT(config)
    placement = args.engine.removeprefix("shardwise-")
    if args.device_budget_gib:
        budget = int(args.device_budget_gib * 2**30)
    else:  # the engine's default on CUDA: the capacity less 10%
        budget = int(torch.cuda.get_device_properties(0).total_memory * 0.9)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    answer = plan(
        model, world_size=1, device_memory_bytes=budget, host_memory_bytes=host,
        param_dtype=torch.float32,
        compute_dtype=torch.bfloat16, reduce_dtype=torch.float32,
        optimizer="adamw" if placement == "cuda" else "hybridadam",
        chunk_size_numel=int(args.chunk_mib * 2**20 / 2),
    )  # fmt: skip
    option = next(o for o in answer.options if o.stage == 3 and o.placement == placement)
    return {
        "device_state_gib": option.device.total / 2**30,
        "working_gib": option.working_bytes / 2**30,
        "host_gib": option.host.total / 2**30,
        "fits": option.fits,
    }


def largest(args: argparse.Namespace) -> dict[str, Any]:
    engine = "torch" if args.placement == "torch" else f"shardwise-{args.placement}"
    attempts = []
    for n_layer in (int(n) for n in args.layers.split(",")):
        out = f"{args.out}.{n_layer}.json"
        command = [
            sys.executable, __file__, "once", "--engine", engine, "--n-layer", str(n_layer),
            "--out", out, *_shape_flags(args),
        ]  # fmt: skip
        print(f"{engine}: {n_layer} layers", flush=True)
        ran = attempt(command, args.attempt_timeout, Path(f"{args.out}.{n_layer}.log"))
        if ran["outcome"] == "ok":
            with open(out) as handle:
                attempts.append({"n_layer": n_layer, "trained": True, **json.load(handle)})
            break
        attempts.append({"n_layer": n_layer, "trained": False, "error": ran["log_tail"]})
    return {"engine": engine, "attempts": attempts}


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def attempt(
    command: list[str], timeout: float, log: Path, limit_gib: float | None = None
) -> dict[str, Any]:
    """Run `command` in a process (and session) of its own, its output to `log`, so that
    running out of memory, a hang or a crash ends only this attempt: stopped past `timeout`
    seconds, or when its process tree's resident set passes `limit_gib` (default: the host's
    memory less 8 GiB, so the attempt goes before the host's OOM killer picks a process).
    Returns its outcome ("ok", "exit N", "killed by signal N", "past the T s limit", "over
    the L GiB limit"), seconds, the highest resident set seen (GiB) and the log's last lines."""
    from bench_memory import _watch

    # Without psutil, no watchdog: the timeout only.
    watch = _watch if importlib.util.find_spec("psutil") else _wait
    if limit_gib is None:
        limit_gib = host_memory_bytes() / 2**30 - 8
    started = time.perf_counter()
    with open(log, "wb") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            stopped, highest = watch(process, timeout, limit_gib)
        finally:  # also when this process is stopped (see main): no attempt outlives it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            code = process.wait()
    if stopped:
        outcome = stopped
    elif code == 0:
        outcome = "ok"
    else:
        outcome = f"killed by signal {-code}" if code < 0 else f"exit {code}"
    text = log.read_text(errors="replace")
    return {
        "outcome": outcome,
        "seconds": round(time.perf_counter() - started, 1),
        "highest_tree_gib": round(highest, 2),
        "log_tail": "" if outcome == "ok" else text[-1500:],
    }


def _wait(process: subprocess.Popen[bytes], timeout: float, _: float) -> tuple[str, float]:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        return f"past the {timeout:g} s limit", 0.0
    return "", 0.0


def session_facts() -> dict[str, Any]:
    """What a results block names: the device, the versions, the host and the commit."""
    facts: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "host_memory_gib": round(host_memory_bytes() / 2**30, 1),
        "commit": _commit(),
        **_device_facts(),
    }
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        facts["transformers"] = importlib.metadata.version("transformers")
    return facts


def _commit() -> str:
    """The working tree's commit and whether its packages or benchmarks differ from it; else
    $COMMIT (a copy of the tree without its .git)."""
    root = Path(__file__).resolve().parents[1]

    def git(*words: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *words], capture_output=True, text=True, timeout=30
        )
        if done.returncode:
            raise OSError(done.stderr)
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", "packages", "benchmarks")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("COMMIT", "unknown (no git)")
    return commit + (" with uncommitted changes" if changed else "")


def _shape_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--n-embd", str(args.n_embd), "--n-head", str(args.n_head), "--vocab", str(args.vocab),
        "--seq", str(args.seq), "--batch", str(args.batch), "--chunk-mib", str(args.chunk_mib),
        "--warmup", str(args.warmup), "--steps", str(args.steps),
        *(["--device-budget-gib", str(args.device_budget_gib)] if args.device_budget_gib else []),
    ]  # fmt: skip


def _device_facts() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"device": "cpu"}
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "device_memory_gib": props.total_memory / 2**30}


def main() -> None:
    # The parts in files of their own take the rest of the command line.
    elsewhere = {
        "bounds": "bench_gpu_bounds", "llama": "bench_gpu_llama", "report": "bench_gpu_report"
    }  # fmt: skip
    # Stopped by `timeout` (SIGTERM), unwind so that `attempt` ends the attempt it runs.
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    if len(sys.argv) > 1 and sys.argv[1] in elsewhere:
        importlib.import_module(elsewhere[sys.argv[1]]).main(sys.argv[2:])
        return
    args = parse_args()
    if args.part == "largest":
        summary = largest(args)
    else:
        init_single_rank()
        summary = compare(args) if args.part == "compare" else once(args)
        dist.destroy_process_group()
    with open(args.out, "w") as handle:
        json.dump(summary, handle, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
