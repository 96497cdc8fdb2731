"""Saving and loading a checkpoint at a size where it matters, measured from outside.

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/bench_checkpoint.py \
        --size 117m --out ckpt.json --results benchmarks/RESULTS.md
    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/bench_checkpoint.py \
        --size smoke --out s.json                                        (tiny, seconds)

A GPT (bench_memory.py's shapes: width 1024, vocabulary 32768, untied head; fp32, fused
AdamW-based HybridAdam) is boosted by GeminiPlugin with a user's defaults but fp32 (a CPU host),
takes one step, and is saved and loaded in turn:
  sharded        booster.save_model / save_optimizer with shard=True: every rank writes its own
                 files of the Hugging Face / ColossalAI layout, one gathered chunk at a time
  one file       the same with shard=False: rank 0 receives everything and writes one file
                 (how ColossalAI's Gemini saves, sharded or not: it gathers on rank 0)
  load sharded   booster.load_model / load_optimizer of the sharded save
  engine save    shardwise.checkpoint.save of the same model and optimizer: each rank its own
                 shards, with torch.distributed.checkpoint (the Lightning strategies'
                 state_dict_type="sharded", world-size independent)
  engine load    shardwise.checkpoint.load of it
Then the same GPT under torch FSDP2 (fully_shard per block) with fused AdamW is saved and
loaded with torch.distributed.checkpoint (each rank its own shards, torch's own format):
  fsdp2 dcp save, fsdp2 dcp load
For each, per rank: the peak resident set above the resident set just before the call
(`VmHWM` after a reset through /proc/self/clear_refs), and wall time; the worse rank is kept.
Loads read torch files memory-mapped: the pages read count in the resident set while a file is
open (the kernel can drop them, unlike allocated memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MIB = 2**20
SIZES = {"117m": (4, 1024, 32768), "168m": (8, 1024, 32768), "smoke": (2, 64, 512)}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _measure(name: str, action: Callable[[], None], results: dict[str, Any]) -> None:
    """Run `action` on every rank; keep the worse rank's peak resident increase and time."""
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident set
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    action()
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = (_status_kib("VmHWM") - before) / 1024
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (peak, seconds))
    results[name] = {
        "peak_mib": max(p for p, _ in gathered),
        "seconds": max(s for _, s in gathered),
    }


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _gpt(size: str) -> Any:
    from shardwise.testing import GPT, GPTConfig

    layers, width, vocab = SIZES[size]
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=vocab,
        block_size=64,
        n_layer=layers,
        n_head=max(1, width // 128),
        n_embd=width,
        tie_weights=False,
    )
    return GPT(config), config


def _one_step(model: Any, optimizer: Any, config: Any, backward: Callable[[Any], None]) -> None:
    from shardwise.testing import gpt_batch

    idx, targets = gpt_batch(config, 2, 64, dist.get_rank())
    _, loss = model(idx, targets)
    backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def shardwise_part(size: str, root: Path, results: dict[str, Any]) -> int:
    from shardwise.booster import Booster
    from shardwise.booster.plugin import GeminiPlugin
    from shardwise.nn.optimizer import HybridAdam

    module, config = _gpt(size)
    params = sum(p.numel() for p in module.parameters())
    booster = Booster(plugin=GeminiPlugin(precision="fp32"))
    optimizer = HybridAdam(module.parameters(), lr=1e-4)
    model, optimizer, *_ = booster.boost(module, optimizer)
    _one_step(model, optimizer, config, lambda loss: booster.backward(loss, optimizer))
    sharded, whole = root / "sharded", root / "whole"

    def save_sharded() -> None:
        booster.save_model(model, str(sharded / "model"), shard=True, use_safetensors=True)
        booster.save_optimizer(optimizer, str(sharded / "optim"), shard=True)

    def save_whole() -> None:
        booster.save_model(model, str(whole / "model.bin"), shard=False)
        booster.save_optimizer(optimizer, str(whole / "optim.bin"), shard=False)

    def load_sharded() -> None:
        booster.load_model(model, str(sharded / "model"))
        booster.load_optimizer(optimizer, str(sharded / "optim"))

    from shardwise import checkpoint

    engine_ckpt = root / "engine"

    def save_engine() -> None:
        checkpoint.save(engine_ckpt, model, optimizer.engine)

    def load_engine() -> None:
        checkpoint.load(engine_ckpt, model, optimizer.engine)

    if dist.get_rank() == 0:
        whole.mkdir(parents=True)
    _measure("sharded save", save_sharded, results)
    results["sharded save"]["bytes"] = _bytes(sharded)
    _measure("one file save", save_whole, results)
    results["one file save"]["bytes"] = _bytes(whole)
    dist.barrier()  # every rank has counted the bytes before rank 0 removes them
    if dist.get_rank() == 0:
        shutil.rmtree(whole)
    _measure("sharded load", load_sharded, results)
    if dist.get_rank() == 0:
        shutil.rmtree(sharded)
    _measure("engine save", save_engine, results)
    results["engine save"]["bytes"] = _bytes(engine_ckpt.resolve())
    _measure("engine load", load_engine, results)
    dist.barrier()
    if dist.get_rank() == 0:
        target = engine_ckpt.resolve()
        engine_ckpt.unlink()
        shutil.rmtree(target)
    return params


def fsdp2_part(size: str, root: Path, results: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    module, config = _gpt(size)
    for block in module.blocks:
        fully_shard(block)
    fully_shard(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
    _one_step(module, optimizer, config, lambda loss: loss.backward())
    where = root / "dcp"

    def save() -> None:
        state = {
            "model": get_model_state_dict(module),
            "optim": get_optimizer_state_dict(module, optimizer),
        }
        dcp.save(state, checkpoint_id=str(where))

    def load() -> None:
        state = {
            "model": get_model_state_dict(module),
            "optim": get_optimizer_state_dict(module, optimizer),
        }
        dcp.load(state, checkpoint_id=str(where))
        set_model_state_dict(module, state["model"])
        set_optimizer_state_dict(module, optimizer, state["optim"])

    _measure("fsdp2 dcp save", save, results)
    results["fsdp2 dcp save"]["bytes"] = _bytes(where)
    _measure("fsdp2 dcp load", load, results)
    if dist.get_rank() == 0:
        shutil.rmtree(where)


def write_results(result: dict[str, Any], path: Path, command: str) -> None:
    from bench_memory import _write_block

    params = result["params"]
    state_mib = params * 16 / result["world"] / MIB
    lines = [
        "## Checkpoints at scale (save and load, measured from outside)",
        "",
        f"Written by `{command}`: a {params / 1e6:.0f}M-parameter GPT, fp32 with Adam, "
        f"{result['world']} ranks (model state {state_mib:.0f} MiB per rank at stage 3). Per "
        f"rank, the worse of the ranks: the peak resident set during the call above the one "
        f"before it, and wall time.",
        "",
        "| call | peak above before (MiB) | seconds | bytes written |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, figures in result["calls"].items():
        written = f"{figures['bytes'] / MIB:,.0f} MiB" if "bytes" in figures else ""
        lines.append(
            f"| {name} | {figures['peak_mib']:,.0f} | {figures['seconds']:.1f} | {written} |"
        )
    calls = result["calls"]
    ratio = calls["sharded save"]["peak_mib"] / calls["one file save"]["peak_mib"]
    lines += [
        "",
        f"The sharded save's peak is {ratio:.2f} "
        f"of the one-file save's (rank 0 receiving everything, as ColossalAI's Gemini saves): a "
        f"rank holds one gathered chunk and the file it is filling. FSDP2's "
        f"torch.distributed.checkpoint writes each rank's shards as they lie, in torch's own "
        f"format, so it gathers nothing; the Hugging Face layout needs whole tensors. Loads read "
        f"torch files memory-mapped, whose pages count in the resident set while open. The "
        f"engine's own save hands torch.distributed.checkpoint views of its shards, which it "
        f"copies one tensor at a time as it writes them (a slice of a chunk), where FSDP2's "
        f"shards are tensors of their own that it writes as they are. The engine's load reads "
        f"into fresh tensors and puts them in place only once every rank has read the whole "
        f"checkpoint, so a load that fails leaves the run as it was; FSDP2's reads into the "
        f"live tensors.",
    ]
    _write_block(path, "bench_checkpoint", lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="117m")
    parser.add_argument("--out", required=True)
    parser.add_argument("--results", type=Path, help="write the table into this file")
    parser.add_argument("--dir", help="where to write the checkpoints (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import shardwise

    shardwise.launch_from_torch()
    base = tempfile.mkdtemp(prefix="bench-ckpt-") if args.dir is None else args.dir
    names: list[Any] = [base]
    dist.broadcast_object_list(names, src=0)
    root = Path(names[0])
    calls: dict[str, Any] = {}
    params = shardwise_part(args.size, root, calls)
    fsdp2_part(args.size, root, calls)
    if dist.get_rank() == 0:
        result = {"params": params, "world": dist.get_world_size(), "calls": calls}
        Path(args.out).write_text(json.dumps(result, indent=2))
        if args.results is not None:
            command = (
                "python -m torch.distributed.run --standalone "
                f"--nproc-per-node={dist.get_world_size()} benchmarks/bench_checkpoint.py "
                f"--size {args.size} --out OUT.json --results benchmarks/RESULTS.md"
            )
            write_results(result, args.results, command)
        print(json.dumps(calls, indent=2))
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    # Every figure is written. After torch.distributed.checkpoint and FSDP2 on gloo, about one
    # run in ten aborts in torch's teardown ("terminate called without an active exception"),
    # with or without destroy_process_group; ending here skips that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
