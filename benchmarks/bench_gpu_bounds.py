"""What bounds a step with its state on the host: three rates of the machine, apart from any
engine.

    python benchmarks/bench_gpu.py bounds --out bounds.json
    python benchmarks/bench_gpu.py bounds --smoke --out bounds.json     (seconds, any machine)

copies: host<->device copies from and into pinned host memory (`torch.empty(...,
pin_memory=True)`), each direction on a side stream of its own, alone and both at once (GB/s,
10^9 bytes a second; both at once: each direction's bytes over the time both took), per copy
size; pageable host memory each way beside them. CUDA only (skipped with a note elsewhere).

adam: `--adam-numel` fp32 parameters in tensors of `--adam-tensor-numel` (a chunk's shard), on
the host, stepped by shardwise's HybridAdam alone and by `torch.optim.AdamW(fused=True)` on the
host's cores (`torch.get_num_threads()`): parameters a second, one warm-up step (it allocates
the moments) then the median of `--repeats` steps.

host_copy: `dst.copy_(src)` of `--host-copy-mib` on the host: bytes copied a second, and
read+written (twice that).

Each figure is the median of `--repeats` timings. The report (bench_gpu_report.py) turns these
into the least time a 10.8B step with its optimizer on the host can take.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_gpu import session_facts

MIB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="small sizes, any machine")
    parser.add_argument("--copy-mib", default="64,1024", help="copy sizes (MiB), comma-separated")
    parser.add_argument("--adam-numel", type=int, default=512 * 2**20)
    parser.add_argument("--adam-tensor-numel", type=int, default=16 * 2**20)
    parser.add_argument("--host-copy-mib", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.smoke:
        args.copy_mib, args.adam_numel, args.adam_tensor_numel = "4", 2**22, 2**20
        args.host_copy_mib, args.repeats = 64, 2
    return args


def _median_seconds(run: Callable[[], None], repeats: int, sync: bool) -> float:
    times = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def copies(sizes_mib: list[int], repeats: int) -> dict[str, Any]:
    """GB/s of pinned host->device, device->host and both at once, per size; pageable too."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: host<->device copies are measured on a GPU only"}
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    return {"sizes": [_copy_rates(mib * MIB, streams, repeats) for mib in sizes_mib]}


def _copy_rates(
    numel: int, streams: tuple[torch.cuda.Stream, torch.cuda.Stream], repeats: int
) -> dict[str, Any]:
    """Copies of `numel` bytes, host->device on the first stream, device->host on the second."""
    pinned = torch.ones(numel, dtype=torch.uint8, pin_memory=True)
    pinned_back = torch.empty(numel, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(numel, dtype=torch.uint8)
    pageable_back = torch.empty(numel, dtype=torch.uint8)
    on_device = torch.ones(numel, dtype=torch.uint8, device="cuda")
    on_device_back = torch.empty(numel, dtype=torch.uint8, device="cuda")

    def up(src: torch.Tensor = pinned) -> None:
        with torch.cuda.stream(streams[0]):
            on_device_back.copy_(src, non_blocking=True)

    def down(dst: torch.Tensor = pinned_back) -> None:
        with torch.cuda.stream(streams[1]):
            dst.copy_(on_device, non_blocking=True)

    def both() -> None:
        up()
        down()

    def rate(run: Callable[[], None]) -> float:
        run()  # warm-up
        return round(numel / _median_seconds(run, repeats, sync=True) / 1e9, 2)

    return {
        "mib": numel // MIB,
        "pinned_h2d_gbps": rate(up),
        "pinned_d2h_gbps": rate(down),
        "pinned_both_each_gbps": rate(both),
        "pageable_h2d_gbps": rate(lambda: up(pageable)),
        "pageable_d2h_gbps": rate(lambda: down(pageable_back)),
    }


def adam(numel: int, tensor_numel: int, repeats: int) -> dict[str, Any]:
    """Parameters a second that HybridAdam and fused AdamW step on the host's cores."""
    from shardwise import HybridAdam

    count = max(1, numel // tensor_numel)
    params = [torch.nn.Parameter(torch.zeros(tensor_numel)) for _ in range(count)]
    for param in params:
        param.grad = torch.full_like(param, 1e-3)
    total = count * tensor_numel
    result: dict[str, Any] = {"params": total, "tensors": count, "threads": torch.get_num_threads()}
    makers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "hybrid_adam": lambda: HybridAdam(params, lr=1e-4),
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=1e-4, fused=True),
    }
    for name, make in makers.items():
        optimizer = make()
        optimizer.step()  # allocates the moments
        seconds = _median_seconds(optimizer.step, repeats, sync=False)
        result[name] = {"step_s": round(seconds, 4), "params_per_s": round(total / seconds)}
        del optimizer
    return result


def host_copy(mib: int, repeats: int) -> dict[str, Any]:
    src = torch.ones(mib * MIB // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touches every page
    seconds = _median_seconds(lambda: dst.copy_(src), repeats, sync=False)
    copied = mib * MIB / seconds / 1e9
    return {
        "mib": mib,
        "threads": torch.get_num_threads(),
        "copy_gbps": round(copied, 2),
        "read_write_gbps": round(2 * copied, 2),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = {
        "kind": "bounds",
        "smoke": args.smoke,
        "session": session_facts(),
        "copies": copies([int(m) for m in args.copy_mib.split(",")], args.repeats),
        "adam": adam(args.adam_numel, args.adam_tensor_numel, args.repeats),
        "host_copy": host_copy(args.host_copy_mib, args.repeats),
    }
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
