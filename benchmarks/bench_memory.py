"""Memory of each engine at sizes where model state dominates, measured from outside.

    python benchmarks/bench_memory.py compare --sizes 117m,168m --out mem.json --results RESULTS.md
    python benchmarks/bench_memory.py compare --smoke --out s.json        (tiny, seconds)

(bench_largest.py, the largest model per engine, launches this file's `one` for each attempt.)

compare: for every engine (torch DDP and FSDP2, shardwise stages 1-3 with the defaults a user
gets; stage 3 under the "cuda", "cpu" and "auto" placements), each in a run of its own under
`torchrun --nproc-per-node=2` (`--ranks`), a GPT of width 1024 and vocabulary 32768 (untied
head) trains `--steps` steps of 2 sequences of 64 tokens per rank in fp32 with fused AdamW.
Each rank reads its resident set (`VmRSS`) and high-water mark (`VmHWM`, reset through
`/proc/self/clear_refs` at each phase) from `/proc/self/status`, minus the resident set before
the model was built:
  build+wrap   peak while the model is built and wrapped (the model is built whole first, as a
               user builds it: its 4 bytes per parameter are the floor of this column)
  after wrap   resident once model and optimizer are wrapped
  forward      peak during the last step's forward
  backward     peak during the last step's backward
  step         peak during the last optimizer step
  after step   resident after it (what the engine keeps between steps)
  peak         peak over all steps (the first step allocates the optimizer state)
beside ZeRO's model-state bytes per rank (fp32 Adam: 16 B/param for DDP, 4 + 12/N at stage 1,
4 + 12/N at stage 2 (the gradient too is sharded, but stage 1 keeps it whole: 8 + 8/N), 16/N at
stage 3 and FSDP2) and the largest unit an engine gathers at once (payload and gradient: a
stage-3 chunk, an FSDP2 group, a stage-1/2 or DDP gradient bucket). On CUDA each phase also
reads `torch.cuda.max_memory_allocated`.

Engines beyond the defaults: `zero2-offload` (stage 2 with `cpu_offload`), `zero3-disk` (stage
3, "cpu" placement, every fp32 master and optimizer state on the disk tier under `--disk-dir`),
`zero3-disk-bf16` (the same with bf16 parameter storage, fp32 compute and masters),
`fsdp2-bf16` (FSDP2 over a bf16 model, gathered and computing in fp32: its 16-bit storage, with
torch's AdamW, fused unless `--foreach` as for every engine, keeping its state in bf16),
`zero3-cuda-wholestep` (the optimizer stepping every shard in one call, as before the
chunk-by-chunk step), `-pool` (`host_buffer_pool=True`). `--meta` builds the model on the
meta device and lets the engine initialise it shard by shard (never whole); `--foreach` gives
every engine torch's foreach AdamW (CUDA's default) instead of the fused one; `--chunk-numel`
sets stage 3's chunk size (default: searched). Each phase also records the bytes the rank's
process wrote and read (`/proc/self/io`'s wchar and rchar: the disk tier's files).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from engines import whole_step

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import GPT, GPTConfig, gpt_batch

ENGINES = ("ddp", "fsdp2", "zero1", "zero2", "zero3-cuda", "zero3-cpu", "zero3-auto")
MORE_ENGINES = (
    *("zero2-offload", "zero3-disk", "zero3-disk-bf16", "fsdp2-bf16", "zero3-cuda-wholestep"),
    *("zero3-cuda-pool", "zero2-pool"),
)
MIB = 2**20
# GPT shapes by name: (layers, width, vocabulary); untied head, 8 heads of 128.
SIZES = {"117m": (4, 1024, 32768), "168m": (8, 1024, 32768), "smoke": (2, 64, 512)}
# torch's DDP default bucket (25 MiB) and shardwise's default stage-1/2 bucket / stage-3 search.
DDP_BUCKET_BYTES = 25 * MIB


# ---- inside one rank ---------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


class Meter:
    """Resident-set phases of this process, relative to a baseline taken at construction."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base_kib = _status_kib("VmRSS")
        self.phases: dict[str, float] = {}

    def reset_peak(self) -> None:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current resident set
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak(self, name: str) -> None:
        self.phases[name] = (_status_kib("VmHWM") - self.base_kib) / 1024
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.phases[name + " cuda"] = torch.cuda.max_memory_allocated() / MIB

    def now(self, name: str) -> None:
        self.phases[name] = (_status_kib("VmRSS") - self.base_kib) / 1024
        if self.device.type == "cuda":
            self.phases[name + " cuda"] = torch.cuda.memory_allocated() / MIB


def io_bytes() -> dict[str, int]:
    """Bytes this process has written and read through system calls (files, the disk tier's
    among them; sockets too, which gloo uses: compare engines, not absolute figures)."""
    counters = {}
    with open("/proc/self/io") as io:
        for line in io:
            key, value = line.split(":")
            counters[key] = int(value)
    return {"written": counters["wchar"], "read": counters["rchar"]}


def _model_config(size: str) -> GPTConfig:
    layers, width, vocab = SIZES[size] if size in SIZES else _layers_size(size)
    return GPTConfig(
        vocab_size=vocab,
        block_size=64,
        n_layer=layers,
        n_head=max(1, width // 128),
        n_embd=width,
        tie_weights=False,
    )


def _layers_size(size: str) -> tuple[int, int, int]:
    # "L<layers>x<width>": the shapes bench_largest.py tries.
    layers, width = size.removeprefix("L").split("x")
    return int(layers), int(width), 32768


def _adamw(params: Any, foreach: bool) -> torch.optim.Optimizer:
    if foreach:
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def _init_sharded(model: torch.nn.Module, device: torch.device) -> None:
    """FSDP2 over a meta-device model: storage for the shards, then each module's own
    initialisation, shard by shard."""
    model.to_empty(device=device)
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def _build(
    engine: str,
    model: GPT,
    device: torch.device,
    budget: int,
    *,
    foreach: bool = False,
    disk_dir: str | None = None,
    chunk_numel: int | None = None,
) -> Any:
    """The training step of `engine` over `model`, as a user sets it up (its defaults), and the
    largest unit it gathers at once in bytes (payload and gradient)."""
    if engine == "fsdp2-bf16":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # Stored and stepped in bf16 (AdamW's state too), gathered and computing in fp32.
        policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        meta = next(model.parameters()).is_meta
        model.to(torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if meta:
            _init_sharded(model, device)
        block_numel = sum(p.numel() for p in model.blocks[0].parameters())
        optimizer = _adamw(model.parameters(), foreach)

        def bf16_forward(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad()
            loss: torch.Tensor = model(idx, targets)[1]
            return loss

        return bf16_forward, lambda loss: loss.backward(), optimizer.step, 2 * 4 * block_numel
    if engine in ("ddp", "fsdp2"):
        if engine == "ddp":
            wrapped: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
            unit = DDP_BUCKET_BYTES
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            meta = next(model.parameters()).is_meta
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            root_numel = sum(
                p.numel() for n, p in model.named_parameters() if not n.startswith("blocks.")
            )
            block_numel = sum(p.numel() for p in model.blocks[0].parameters())
            fully_shard(model, mesh=mesh)
            if meta:
                _init_sharded(model, device)
            unit = 2 * 4 * max(root_numel, block_numel)
        optimizer = _adamw(wrapped.parameters() if engine == "ddp" else model.parameters(), foreach)
        module = wrapped if engine == "ddp" else model

        def torch_forward(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            optimizer.zero_grad()
            loss: torch.Tensor = module(idx, targets)[1]
            return loss

        return torch_forward, lambda loss: loss.backward(), optimizer.step, unit
    stage = int(engine[4])
    config: dict[str, Any] = {"device": device}
    if chunk_numel is not None and stage == 3:
        config["chunk_size_numel"] = chunk_numel
    parts = engine.split("-")
    if stage == 3:
        placement = parts[1]
        config["placement_policy"] = "cpu" if placement == "disk" else placement
        if placement == "auto":
            config["device_budget_bytes"] = budget
        if placement == "disk":
            config.update(nvme_offload_fraction=1.0, nvme_offload_dir=disk_dir)
    config["host_buffer_pool"] = "pool" in parts
    if "bf16" in parts:
        config["mixed_precision"] = MixedPrecision(
            param_dtype=torch.bfloat16, compute_dtype=torch.float32
        )
    zero_model = zero_model_wrapper(model, stage, config)
    zero_optimizer = zero_optim_wrapper(
        zero_model,
        _adamw(zero_model.parameters(), foreach),
        optim_config={"cpu_offload": True} if "offload" in parts else None,
    )
    if "wholestep" in parts:
        zero_optimizer._step_chunk_by_chunk = types.MethodType(  # type: ignore[method-assign]
            whole_step, zero_optimizer
        )
    chunks = zero_model.chunk_manager.chunks
    largest = max(c.padded_numel for c in chunks) * 4
    unit = 2 * largest

    def zero_forward(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        zero_optimizer.zero_grad()
        loss: torch.Tensor = zero_model(idx, targets)[1]
        return loss

    return zero_forward, zero_optimizer.backward, zero_optimizer.step, unit


def model_state_bytes(engine: str, params: int, world: int) -> float:
    """ZeRO's model-state bytes per rank for fp32 Adam (the ZeRO paper's formulas, K = 12)."""
    per_param = {
        "ddp": 16.0,
        "zero1": 4 + 4 + 8 / world,  # whole parameters and gradients, sharded moments
        "zero2": 4 + 12 / world,
        "fsdp2": 16 / world,
    }.get(engine.removesuffix("-pool"), 16 / world)
    return per_param * params


def run_one(args: argparse.Namespace) -> None:
    """One engine, under torchrun: rank 0 writes every rank's phases to `--out`."""
    torch.set_num_threads(1)
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if (torch.cuda.is_available() and not args.cpu)
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = _model_config(args.size)
    meter = Meter(device)
    meter.reset_peak()
    torch.manual_seed(0)
    with torch.device("meta" if args.meta else device):
        model = GPT(config)
    params = model.num_parameters()
    state = model_state_bytes(args.engine, params, world)
    forward, backward, step, unit = _build(
        args.engine,
        model,
        device,
        int(state * 0.5),
        foreach=args.foreach,
        disk_dir=args.disk_dir,
        chunk_numel=args.chunk_numel,
    )
    del model  # the engine holds what it needs
    meter.peak("build+wrap")
    meter.now("after wrap")
    meter.reset_peak()
    peaks: dict[str, list[float]] = {"": [], " cuda": []}
    step_seconds = []
    io_per_step = []
    for index in range(args.steps):
        idx, targets = gpt_batch(config, args.sequences * world, args.seq, index)
        idx, targets = idx.chunk(world)[rank].to(device), targets.chunk(world)[rank].to(device)
        io_before = io_bytes()
        started = time.perf_counter()
        meter.reset_peak()
        loss = forward(idx, targets)
        meter.peak("forward")
        meter.reset_peak()
        backward(loss)
        meter.peak("backward")
        meter.reset_peak()
        step()
        meter.peak("step")
        meter.now("after step")
        step_seconds.append(time.perf_counter() - started)
        io_after = io_bytes()
        io_per_step.append({k: io_after[k] - io_before[k] for k in io_after})
        print(f"rank {rank} step {index}: {step_seconds[-1]:.1f} s", flush=True)
        for suffix, seen in peaks.items():
            if "forward" + suffix in meter.phases:
                seen.append(max(meter.phases[p + suffix] for p in ("forward", "backward", "step")))
    for suffix, seen in peaks.items():
        if seen:
            meter.phases["peak" + suffix] = max(seen)
    record = {
        "rank": rank,
        "phases": meter.phases,
        "loss": float(loss.detach()),
        "unit_bytes": unit,
        "step_seconds": step_seconds,
        "io_per_step": io_per_step,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, record)
    if rank == 0:
        result = {
            "engine": args.engine,
            "size": args.size,
            "params": params,
            "world": world,
            "device": str(device),
            "model_state_bytes": state,
            "ranks": gathered,
        }
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


# ---- the driver --------------------------------------------------------------------------------


def launch(
    engine: str,
    size: str,
    steps: int,
    out: Path,
    timeout: float,
    limit_gib: float,
    cpu: bool,
    extra: list[str] | None = None,
    ranks: int = 2,
    env: dict[str, str] | None = None,
) -> tuple[str, float]:
    """Run one engine in processes of its own; stop it when its tree's resident set passes
    `limit_gib` or it runs past `timeout`. `env`: the run's environment (default: this one's).
    Returns (outcome, highest resident GiB seen)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        __file__,
        "one",
        "--engine",
        engine,
        "--size",
        size,
        "--steps",
        str(steps),
        "--out",
        str(out),
        *(["--cpu"] if cpu else []),
        *(extra or []),
    ]
    environment = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
    # Output to a file, not a pipe: a rank orphaned by a failed launcher would hold a pipe open.
    with tempfile.TemporaryFile() as log_file:
        process = subprocess.Popen(
            command,
            env=environment,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        outcome, highest = _watch(process, timeout, limit_gib)
        # The launcher's session: whatever is left of it goes (its ranks went in _watch).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait()
        log_file.seek(0)
        log = log_file.read().decode(errors="replace")
    if not outcome:
        outcome = "ok" if process.returncode == 0 and out.exists() else "failed"
    if outcome != "ok":
        print(log[-3000:], file=sys.stderr)
    return outcome, highest


def _watch(process: subprocess.Popen[bytes], timeout: float, limit_gib: float) -> tuple[str, float]:
    """Poll the resident set of `process`'s tree until it ends, passes `limit_gib` or runs
    past `timeout`: ("" when it ended by itself, or what it passed; the highest GiB seen).
    Then every process seen below `process` goes: torchrun starts each rank in a session of
    its own, out of reach of the launcher's, and a rank outliving its attempt would hold its
    memory (and the disk tier's files) through the next."""
    import psutil

    deadline = time.monotonic() + timeout
    highest, outcome = 0.0, ""
    seen: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(process.pid)
    except psutil.Error:  # ended already
        return "", highest
    while process.poll() is None:
        resident = 0
        with contextlib.suppress(psutil.Error):
            for member in [root, *root.children(recursive=True)]:
                seen.setdefault(member.pid, member)
                with contextlib.suppress(psutil.Error):
                    resident += member.memory_info().rss
        highest = max(highest, resident / 2**30)
        if resident > limit_gib * 2**30:
            outcome = f"over the {limit_gib:g} GiB limit"
            break
        if time.monotonic() > deadline:
            outcome = f"past the {timeout:g} s limit"
            break
        time.sleep(0.05)
    below = [member for pid, member in seen.items() if pid != process.pid]
    for member in below:
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(below, timeout=60)
    return outcome, highest


def passed_on(args: argparse.Namespace) -> list[str]:
    """The options a launched run takes from the driver's."""
    return [
        *(["--meta"] if args.meta else []),
        *(["--foreach"] if args.foreach else []),
        *(["--disk-dir", args.disk_dir] if args.disk_dir else []),
        *(["--chunk-numel", str(args.chunk_numel)] if args.chunk_numel else []),
    ]


def compare(args: argparse.Namespace) -> dict[str, Any]:
    sizes = ["smoke"] if args.smoke else args.sizes.split(",")
    engines = args.engines.split(",")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for size in sizes:
            for engine in engines:
                out = Path(scratch) / f"{engine}-{size}.json"
                once = functools.partial(
                    launch,
                    engine,
                    size,
                    args.steps,
                    out,
                    args.attempt_timeout,
                    args.limit_gib,
                    args.cpu,
                    extra=passed_on(args),
                    ranks=args.ranks,
                )
                outcome, _ = once()
                if outcome.startswith("past the"):
                    # A launch that never got going (its rendezvous, say) is tried once more;
                    # the log of the first went to stderr, and a second hang still fails.
                    print(f"{engine} at {size}: {outcome}; trying once more", file=sys.stderr)
                    outcome, _ = once()
                if outcome != "ok":
                    raise SystemExit(f"{engine} at {size}: {outcome}")
                run = json.loads(out.read_text())
                runs.append(run)
                print(_row(run), flush=True)
    return {"kind": "compare", "steps": args.steps, "runs": runs}


PHASES = ("build+wrap", "after wrap", "forward", "backward", "step", "after step", "peak")


def _row(run: dict[str, Any]) -> str:
    # On CUDA the device's allocator is the figure (its peak per phase); on a CPU the resident set.
    suffix = " cuda" if run["device"].startswith("cuda") else ""
    worst = {p: max(r["phases"][p + suffix] for r in run["ranks"]) for p in PHASES}
    unit = run["ranks"][0]["unit_bytes"] / MIB
    bound = run["model_state_bytes"] / MIB + unit
    cells = " | ".join(f"{worst[p]:,.0f}" for p in PHASES)
    return (
        f"| {run['size']} | {run['engine']} | {cells} | {run['model_state_bytes'] / MIB:,.0f} | "
        f"{unit:,.0f} | {worst['peak'] / bound:.2f} |"
    )


def write_results(
    result: dict[str, Any], path: Path, command: str, block: str | None = None
) -> None:
    """Replace (or add) this benchmark's block (or the one named `block`) in the results
    file."""
    lines = [
        "## Memory at scale (each engine in a run of its own, measured from outside)",
        "",
        f"Written by `{command}`. Per rank, the worse of the ranks, MiB: "
        + (
            "the CUDA allocator's (`max_memory_allocated` in each phase, `memory_allocated` "
            "after it)"
            if any(run["device"].startswith("cuda") for run in result["runs"])
            else "above the resident set before the model was built"
        )
        + " (see the benchmark's docstring for each column).",
        "",
        "| size | engine | build+wrap | after wrap | forward | backward | step | after step | "
        "peak | ZeRO model state | largest unit | peak / (state + unit) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(_row(run) for run in result["runs"]),
    ]
    write_block(path, block or "bench_memory", lines)


def write_block(path: Path, name: str, lines: list[str]) -> None:
    """Replace (or add) the block `name` of the results file."""
    begin_mark, end_mark = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    block = "\n".join([begin_mark, *lines, end_mark])
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    begin, end = text.find(begin_mark), text.find(end_mark)
    if begin >= 0 and end >= 0:
        text = text[:begin] + block + text[end + len(end_mark) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


_write_block = write_block  # the name the other benchmarks import


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["compare", "one"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--engine", help="for `one`")
    parser.add_argument("--size", help="for `one`")
    parser.add_argument("--sizes", default="117m,168m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT: checks the plumbing")
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU where CUDA is there")
    parser.add_argument("--results", type=Path, help="write the compare table into this file")
    parser.add_argument("--limit-gib", type=float, default=20.0, help="all ranks' resident sets")
    parser.add_argument("--attempt-timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (`one`)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per run (1 with one GPU)")
    parser.add_argument("--sequences", type=int, default=2, help="sequences per rank (`one`)")
    parser.add_argument("--meta", action="store_true", help="build it on the meta device")
    parser.add_argument("--foreach", action="store_true", help="foreach AdamW instead of fused")
    parser.add_argument("--disk-dir", help="the disk tier's directory (zero3-disk engines)")
    parser.add_argument("--chunk-numel", type=int, help="stage 3's chunk size (elements)")
    parser.add_argument("--results-block", help="the block of --results (default: its own)")
    args = parser.parse_args()
    if args.part == "one":
        run_one(args)
        return
    result = compare(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.results is not None:
        write_results(
            result,
            args.results,
            "python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            args.results_block,
        )


if __name__ == "__main__":
    main()
