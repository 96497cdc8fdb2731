"""`shardwise plan ...`: predict memory per rank and traffic per step and recommend the first
configuration that fits. Its options, the run from them to the planner, and the output; the
activations (plan_activations.py), the model (plan_model.py) and the memory per rank
(plan_memory.py) are read in modules of their own."""

from __future__ import annotations

import argparse
import json
import sys

from shardwise.subcommands.arguments import (
    DTYPES,
    count,
    positive_int,
    size_in_bytes,
    size_in_bytes_or_zero,
)
from shardwise.subcommands.plan_activations import (
    check_activation_options,
    estimated_activations,
    given_activations,
)
from shardwise.subcommands.plan_memory import memory_per_rank
from shardwise.subcommands.plan_model import MODEL_FORM, meta_model, model_spec

_EPILOG = """\
sizes carry a unit: 80GB, 80GiB, 512MiB, 1.5TB (B, KB, MB, GB, TB, KiB, MiB, GiB,
TiB, in any case). A bare number is refused (is 80 bytes or GB?), but for 0 where
0 means none (--activation-memory, --disk-memory).

without --device-memory / --host-memory it plans for this machine: each rank gets
the first CUDA device's capacity, and the host's memory divided by the ranks per
node (--ranks-per-node; default one per CUDA device, at most --world-size, or,
without CUDA, --world-size: every rank on this host, whose memory the CPU then
computes from as well). The first output line reports what it detected.

activations per rank are given (--activation-memory 6GiB) or, with --model,
estimated from the model on the meta device, nothing allocated (--batch 8
--seq-len 1024: input_ids, and labels where its forward takes them, in the
compute dtype; --checkpointing: with gradient_checkpointing_enable()). The
output says which (--json: "activation_source", and "activation_estimate"'s
parts). Without either, activations are not counted: every device figure is a
lower bound and a configuration marked as fitting may not fit. The output says
so (text: a line; --json: "activations_counted": false).

exit status: 0 when a configuration fits; 1 when none does (the table and advice,
or the --json object, are printed all the same); 2 for a usage error (an option
refused, a --model that does not build).
"""


def add_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add `plan` and its options to `commands` (the subparsers of `shardwise`); the caller
    reports `run`'s ValueErrors through the returned parser."""
    planner = commands.add_parser(
        "plan",
        help="predict memory per rank and recommend a configuration",
        description="Predict memory per rank and traffic per step for DDP, stages 1-3 and the "
        "stage-3 placements, and recommend the first configuration that fits.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = planner.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model", help=f"{MODEL_FORM} (built on the meta device: nothing allocated)"
    )
    source.add_argument("--params", type=count, help="parameter count, e.g. 7.5e9")
    planner.add_argument("--largest-tensor", type=count, help="elements of the largest tensor")
    planner.add_argument("--world-size", type=positive_int, required=True)
    planner.add_argument(
        "--device-memory",
        type=size_in_bytes,
        help="per rank, with a unit, e.g. 80GB (default: this machine's first CUDA device, or "
        "without CUDA this host's share, see --ranks-per-node)",
    )
    planner.add_argument(
        "--host-memory",
        type=size_in_bytes,
        help="per rank, with a unit, e.g. 512GiB (default: this host's memory divided by "
        "--ranks-per-node)",
    )
    planner.add_argument(
        "--ranks-per-node",
        type=positive_int,
        help="ranks sharing this host's detected memory (default: one per CUDA device here, at "
        "most --world-size; without CUDA, --world-size); only with memory detected",
    )
    planner.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter dtype")
    planner.add_argument("--compute-dtype", choices=sorted(DTYPES))
    planner.add_argument("--optimizer", default="adam")
    planner.add_argument("--chunk-size", type=count, help="elements per chunk (default: search)")
    planner.add_argument(
        "--activation-memory",
        type=size_in_bytes_or_zero,
        help="per rank: the bytes a step's activations take on the device, e.g. 6GiB (default: "
        "not counted, and the output says its figures are a lower bound)",
    )
    planner.add_argument(
        "--batch",
        type=positive_int,
        help="with --model and --seq-len: estimate the activations per rank from the model at "
        "this many sequences per rank (its micro-batch) instead of --activation-memory",
    )
    planner.add_argument(
        "--seq-len", type=positive_int, help="with --batch: tokens per sequence, e.g. 1024"
    )
    planner.add_argument(
        "--checkpointing",
        action="store_true",
        help="with --batch: estimate under activation checkpointing (the model's "
        "gradient_checkpointing_enable(), as Hugging Face models have)",
    )
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
        type=size_in_bytes_or_zero,
        default=0,
        help="per rank: what the disk tier's files may take, e.g. 2TB (default 0: no disk tier)",
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
        help="values per quantization block (default: the engine's, 256)",
    )
    planner.add_argument("--json", action="store_true", help="machine-readable output")
    return planner


def run(args: argparse.Namespace) -> int:
    """Plan, print the plan (after any line on what it assumed), and return 0 if a
    configuration fits, else 1. User mistakes raise ValueError."""
    check_activation_options(args)
    import torch

    from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
    from shardwise.planner import ModelSpec, plan

    model = meta_model(args.model) if args.model else None
    if model is not None:
        spec = model_spec(model, args.model)
    else:
        # Without the largest tensor, plan as if no tensor outgrew the default chunk size.
        spec = ModelSpec(num_params=args.params, largest_tensor_numel=args.largest_tensor or 1)
    # After the spec: the estimate casts the model and turns its checkpointing on.
    if args.batch is None:
        said, activations = given_activations(args)
    else:
        assert model is not None  # check_activation_options: --batch comes with --model
        said, activations = estimated_activations(args, model)
    device_memory, host_memory, ranks_per_node, detected = memory_per_rank(args)
    notes = [detected] if detected else []
    notes.append(said)
    result = plan(
        spec,
        world_size=args.world_size,
        device_memory_bytes=device_memory,
        host_memory_bytes=host_memory,
        param_dtype=getattr(torch, DTYPES[args.dtype]),
        compute_dtype=getattr(torch, DTYPES[args.compute_dtype]) if args.compute_dtype else None,
        optimizer=args.optimizer,
        chunk_size_numel=args.chunk_size,
        activation_bytes=activations["activation_bytes"],
        shard_size=args.shard_size,
        secondary_shard_size=args.secondary_shard_size,
        disk_memory_bytes=args.disk_memory,
        gather_format=args.gather_format,
        reduce_format=args.reduce_format,
        quant_block_numel=(
            DEFAULT_QUANT_BLOCK_NUMEL if args.quant_block_numel is None else args.quant_block_numel
        ),
    )
    if args.json:
        output = json.loads(result.to_json())
        output.update(
            device_memory_bytes=device_memory,
            host_memory_bytes=host_memory,
            ranks_per_node=ranks_per_node,
            **activations,
            notes=notes,
        )
        print(json.dumps(output, indent=1))
    else:
        print("\n".join([*notes, result.table()]))
    if result.recommended is None:
        print("shardwise plan: no configuration fits (exit status 1)", file=sys.stderr)
        return 1
    return 0
