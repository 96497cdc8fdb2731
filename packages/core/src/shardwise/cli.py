"""The `shardwise` command: `shardwise plan ...` predicts memory and recommends a configuration;
`shardwise consolidate SRC DST` writes a sharded checkpoint as one file."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

import torch

from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.planner import ModelSpec, plan

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def size_in_bytes(text: str) -> int:
    """'80GB', '80 GiB', '1.5e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (examples: 80GB, 24GiB, 512MB, 1.5e9)"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def count(text: str) -> int:
    try:
        return int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a count: {text!r} (examples: 7.5e9, 125000000)"
        ) from None


def _build_model(target: str) -> torch.nn.Module:
    """Build `package.module:callable` on the meta device: sizes without allocation."""
    module_name, _, attribute = target.partition(":")
    if not attribute:
        raise SystemExit(f"--model must look like package.module:factory, got {target!r}")
    factory = getattr(importlib.import_module(module_name), attribute)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"{target} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise")
    commands = parser.add_subparsers(dest="command", required=True)
    planner = commands.add_parser(
        "plan", help="predict memory per rank and recommend a configuration"
    )
    source = planner.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="package.module:factory building the model (run on meta)")
    source.add_argument("--params", type=count, help="parameter count, e.g. 7.5e9")
    planner.add_argument("--largest-tensor", type=count, help="elements of the largest tensor")
    planner.add_argument("--world-size", type=int, required=True)
    planner.add_argument(
        "--device-memory", type=size_in_bytes, help="per rank (default: this machine's device)"
    )
    planner.add_argument(
        "--host-memory", type=size_in_bytes, help="per rank (default: this host's memory)"
    )
    planner.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="parameter dtype")
    planner.add_argument("--compute-dtype", choices=sorted(_DTYPES))
    planner.add_argument("--optimizer", default="adam")
    planner.add_argument("--chunk-size", type=count, help="elements per chunk (default: search)")
    planner.add_argument("--activation-memory", type=size_in_bytes, default=0)
    planner.add_argument(
        "--shard-size", type=int, help="hybrid sharding: ranks per shard group (e.g. per node)"
    )
    planner.add_argument(
        "--secondary-shard-size",
        type=int,
        help="stage 3, ZeRO++ hpZ: ranks per group backward gathers in (e.g. per node)",
    )
    planner.add_argument(
        "--disk-memory",
        type=size_in_bytes,
        default=0,
        help="per rank: what the disk tier's files may take (default 0: no disk tier)",
    )
    planner.add_argument(
        "--gather-format", default="dtype", help="parameter gathers: dtype, int8 or fp8"
    )
    planner.add_argument(
        "--reduce-format", default="dtype", help="gradient reductions: dtype, int8, fp8 or int4"
    )
    planner.add_argument(
        "--quant-block-numel",
        type=int,
        default=DEFAULT_QUANT_BLOCK_NUMEL,
        help="values per quantization block",
    )
    planner.add_argument("--json", action="store_true", help="machine-readable output")
    merger = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint (e.g. a Lightning trainer.save_checkpoint directory) as "
        "one .ckpt file that load_from_checkpoint and torch.load read without shardwise",
    )
    merger.add_argument("source", help="the sharded checkpoint")
    merger.add_argument("target", help="the file to write, e.g. model.ckpt")
    merger.add_argument("--weights-only", action="store_true", help="leave the optimizer state out")
    merger.add_argument(
        "--no-verify", action="store_true", help="skip the checksums of the source's files"
    )
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        return _consolidate(args)
    if args.model:
        spec = ModelSpec.from_module(_build_model(args.model))
    else:
        # Without the largest tensor, plan as if no tensor outgrew the default chunk size.
        spec = ModelSpec(num_params=args.params, largest_tensor_numel=args.largest_tensor or 1)
    device_memory, host_memory = args.device_memory, args.host_memory
    if device_memory is None or host_memory is None:
        detected_device, detected_host, where = _detected_memory()
        device_memory = device_memory or detected_device
        host_memory = host_memory or detected_host
        if not args.json:
            print(
                f"planning with {where}: device {device_memory / 1e9:.1f} GB, host "
                f"{host_memory / 1e9:.1f} GB per rank (pass --device-memory / --host-memory to "
                f"plan for another machine)"
            )
    try:
        result = plan(
            spec,
            world_size=args.world_size,
            device_memory_bytes=device_memory,
            host_memory_bytes=host_memory,
            param_dtype=_DTYPES[args.dtype],
            compute_dtype=_DTYPES[args.compute_dtype] if args.compute_dtype else None,
            optimizer=args.optimizer,
            chunk_size_numel=args.chunk_size,
            activation_bytes=args.activation_memory,
            shard_size=args.shard_size,
            secondary_shard_size=args.secondary_shard_size,
            disk_memory_bytes=args.disk_memory,
            gather_format=args.gather_format,
            reduce_format=args.reduce_format,
            quant_block_numel=args.quant_block_numel,
        )
    except ValueError as error:
        parser.error(str(error))
    print(result.to_json() if args.json else result.table())
    return 0


def _detected_memory() -> tuple[int, int, str]:
    """This machine's memory: the first CUDA device's capacity (or, without CUDA, host memory,
    which is then the compute device's), and the host's."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        return int(properties.total_memory), host, f"this machine's {properties.name}"
    return host, host, "this host's memory (no CUDA device: the CPU computes)"


def _consolidate(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.consolidate import consolidate

    try:
        written = consolidate(
            args.source,
            args.target,
            optimizer=not args.weights_only,
            verify_checksums=not args.no_verify,
        )
    except ValueError as error:  # CheckpointError included
        print(f"shardwise consolidate: {error}", file=sys.stderr)
        return 2
    numel = sum(t.numel() for t in written["state_dict"].values())
    if "optimizer_states" in written:
        optimizer = "with optimizer state"
    elif args.weights_only:
        optimizer = "weights only"
    else:
        optimizer = (
            "no optimizer state (none saved, or the saver did not name its parameter groups, "
            "as the Lightning strategies do)"
        )
    print(
        f"wrote {args.target}: {len(written['state_dict'])} tensors, {numel} elements, {optimizer}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
