"""The `shardwise` command: `shardwise plan ...` predicts memory and recommends a configuration;
`shardwise consolidate SRC DST` writes a sharded checkpoint as one file.

[Note: detected memory per rank]
Without --device-memory / --host-memory the planner plans for this machine. A CUDA device's
capacity is one rank's own (torchrun starts one rank per device). The host's memory is shared
by the ranks on it, so each rank is credited the host's memory divided by the ranks per node:
--ranks-per-node when given, else one rank per CUDA device here (at most the world size), else,
without CUDA, the world size (CPU runs start every rank on one host: the cautious answer).
Without CUDA the CPU computes from that same share, which the plan then counts as both device
and host memory. The line that reports the detected memory says which rule divided it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import math
import os
import re
import sys
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from shardwise.planner import ModelSpec

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_NUMBER = r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
# The command line's dtype names -> torch's (torch is imported where a command needs it, so
# that `shardwise --version` and `--help` answer at once).
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_MODEL_FORM = "package.module:factory, a callable building the model with no arguments"
_PLAN_EPILOG = """\
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


def size_in_bytes(text: str) -> int:
    """'80GB', '80 GiB', '512MiB', '1.5TB' -> bytes: a number and a unit, decimal (B, KB, MB,
    GB, TB) or binary (KiB, MiB, GiB, TiB), in any case. A bare number is refused: '80' is as
    likely meant in GB as in bytes."""
    match = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z]*)\s*", text)
    if match is None or (match.group(2) and match.group(2).upper() not in _UNITS):
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (examples: 80GB, 80GiB, 512MiB, 1.5TB)"
        )
    number, unit = match.groups()
    if not unit:
        raise argparse.ArgumentTypeError(
            f"{number} has no unit: write {number}GB or {number}GiB (or {number}B for bytes)"
        )
    nbytes = float(number) * _UNITS[unit.upper()]
    if not math.isfinite(nbytes):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} is too large")
    return int(nbytes)


def size_in_bytes_or_zero(text: str) -> int:
    """As `size_in_bytes`, and a bare 0 (none) too."""
    if re.fullmatch(rf"\s*{_NUMBER}\s*", text) and float(text) == 0:
        return 0
    return size_in_bytes(text)


def count(text: str) -> int:
    """'7.5e9', '125000000' -> a whole number."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not value.is_integer():
        raise argparse.ArgumentTypeError(
            f"not a count: {text!r} (a whole number, e.g. 7.5e9, 125000000)"
        )
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive int: {text!r} (e.g. 8)")
    return value


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


_MISSING = object()


def _meta_model(target: str) -> nn.Module:
    """Build `package.module:factory` on the meta device (sizes without allocation).

    Raises ValueError, naming `target` and what was expected, where it builds no module."""
    import torch

    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--model must be {_MODEL_FORM}; got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # whatever the user's module raises while importing
        raise ValueError(
            f"--model {target!r}: module {module_name!r} does not import ({_one_line(error)}); "
            f"expected {_MODEL_FORM}, its module installed or on PYTHONPATH"
        ) from None
    factory = getattr(module, attribute, _MISSING)
    if factory is _MISSING or not callable(factory):
        found = "has no" if factory is _MISSING else "has a non-callable"
        raise ValueError(
            f"--model {target!r}: module {module_name!r} {found} attribute {attribute!r}; "
            f"expected {_MODEL_FORM}"
        )
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:  # whatever the user's factory raises
        raise ValueError(
            f"--model {target!r}: {attribute}() raised {_one_line(error)}; expected it to build "
            f"the model with no arguments on the meta device (no weights loaded, no .to(device))"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"--model {target!r}: {attribute}() returned {type(model).__name__}, expected a "
            f"torch.nn.Module"
        )
    return model


def _model_spec(model: nn.Module, target: str) -> ModelSpec:
    from shardwise.planner import ModelSpec

    try:
        return ModelSpec.from_module(model)
    except ValueError as error:
        raise ValueError(f"--model {target!r}: {error}") from None


def _check_activation_options(args: argparse.Namespace) -> None:
    """Activations come from one source: given, or estimated from --model at a batch."""
    estimate = args.batch is not None or args.seq_len is not None
    if estimate and args.activation_memory is not None:
        raise ValueError(
            "--activation-memory gives the activations and --batch/--seq-len estimate them: "
            "pick one"
        )
    if estimate and (args.batch is None or args.seq_len is None):
        given = "--batch" if args.batch is not None else "--seq-len"
        raise ValueError(
            f"{given} without {'--seq-len' if given == '--batch' else '--batch'}: the estimate "
            f"needs both, sequences per rank and tokens per sequence (e.g. --batch 8 "
            f"--seq-len 1024)"
        )
    if estimate and not args.model:
        raise ValueError(
            "--batch/--seq-len estimate the activations from the model: give it with --model "
            f"({_MODEL_FORM}), or give the activations' bytes per rank with --activation-memory"
        )
    if args.checkpointing and not estimate:
        raise ValueError(
            "--checkpointing applies to the estimate: give --model with --batch and --seq-len "
            "(with --activation-memory, give the bytes measured under checkpointing)"
        )


def main(argv: list[str] | None = None) -> int:
    """Run `shardwise plan` or `shardwise consolidate` on `argv` (default: the command line).

    Returns the exit status: for `plan` 0 when a configuration fits and 1 when none does (the
    output printed all the same); usage errors exit with 2 through argparse.
    """
    parser, planner = _parser()
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        return _consolidate(args)
    try:
        return _plan(args)
    except ValueError as error:
        planner.error(str(error))


def _version() -> str:
    """`shardwise --version`: the installed distribution's version (shardwise.__version__),
    and torch's, read from the installed metadata where torch is not imported yet (importing
    it takes seconds)."""
    try:
        version = importlib.metadata.version("shardwise")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        version = "0+unknown"
    if "torch" in sys.modules:
        torch_version = str(sys.modules["torch"].__version__)
    else:
        try:
            torch_version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:  # a torch built on PYTHONPATH
            import torch

            torch_version = str(torch.__version__)
    return f"shardwise {version} (torch {torch_version})"


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="shardwise")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)
    planner = commands.add_parser(
        "plan",
        help="predict memory per rank and recommend a configuration",
        description="Predict memory per rank and traffic per step for DDP, stages 1-3 and the "
        "stage-3 placements, and recommend the first configuration that fits.",
        epilog=_PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = planner.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model", help=f"{_MODEL_FORM} (built on the meta device: nothing allocated)"
    )
    source.add_argument("--params", type=count, help="parameter count, e.g. 7.5e9")
    planner.add_argument("--largest-tensor", type=count, help="elements of the largest tensor")
    planner.add_argument("--world-size", type=_positive_int, required=True)
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
        type=_positive_int,
        help="ranks sharing this host's detected memory (default: one per CUDA device here, at "
        "most --world-size; without CUDA, --world-size); only with memory detected",
    )
    planner.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="parameter dtype")
    planner.add_argument("--compute-dtype", choices=sorted(_DTYPES))
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
        type=_positive_int,
        help="with --model and --seq-len: estimate the activations per rank from the model at "
        "this many sequences per rank (its micro-batch) instead of --activation-memory",
    )
    planner.add_argument(
        "--seq-len", type=_positive_int, help="with --batch: tokens per sequence, e.g. 1024"
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
    return parser, planner


def _plan(args: argparse.Namespace) -> int:
    """Plan, print the plan (after any line on what it assumed), and return 0 if a
    configuration fits, else 1. User mistakes raise ValueError."""
    _check_activation_options(args)
    import torch

    from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
    from shardwise.planner import ModelSpec, plan

    model = _meta_model(args.model) if args.model else None
    if model is not None:
        spec = _model_spec(model, args.model)
    else:
        # Without the largest tensor, plan as if no tensor outgrew the default chunk size.
        spec = ModelSpec(num_params=args.params, largest_tensor_numel=args.largest_tensor or 1)
    # After the spec: the estimate casts the model and turns its checkpointing on.
    if args.batch is None:
        said, activations = _given_activations(args)
    else:
        assert model is not None  # _check_activation_options: --batch comes with --model
        said, activations = _estimated_activations(args, model)
    device_memory, host_memory, ranks_per_node, detected = _memory_per_rank(args)
    notes = [detected] if detected else []
    notes.append(said)
    result = plan(
        spec,
        world_size=args.world_size,
        device_memory_bytes=device_memory,
        host_memory_bytes=host_memory,
        param_dtype=getattr(torch, _DTYPES[args.dtype]),
        compute_dtype=getattr(torch, _DTYPES[args.compute_dtype]) if args.compute_dtype else None,
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


def _given_activations(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The line saying where the activations came from (--activation-memory, or nowhere: not
    counted) and the JSON's fields for them."""
    if args.activation_memory is None:
        said = (
            "activations not counted (no --activation-memory or --batch/--seq-len): every "
            "device figure is a lower bound and a 'yes' may not fit; pass the bytes a step's "
            "activations take per rank, e.g. --activation-memory 6GiB, or with --model estimate "
            "them, e.g. --batch 8 --seq-len 1024"
        )
    else:
        said = f"activations as given (--activation-memory): {_gb(args.activation_memory)} per rank"
    return said, {
        "activations_counted": args.activation_memory is not None,
        "activation_bytes": args.activation_memory or 0,
        "activation_source": "none" if args.activation_memory is None else "given",
        "activation_estimate": None,
    }


def _estimated_activations(
    args: argparse.Namespace, model: nn.Module
) -> tuple[str, dict[str, Any]]:
    """The activations estimated from `model` (on the meta device) at --batch x --seq-len: the
    line saying so and the JSON's fields, the estimate's parts included."""
    import torch

    from shardwise.planner import estimate_token_activation_bytes

    # A step's activations are in the dtype its forward computes in.
    compute = args.compute_dtype or args.dtype
    model.to(getattr(torch, _DTYPES[compute])).train()
    if args.checkpointing:
        _enable_checkpointing(model, args.model)
    at = f"batch {args.batch} x {args.seq_len}"
    try:
        estimate = estimate_token_activation_bytes(
            model, batch_size=args.batch, seq_len=args.seq_len
        )
    except Exception as error:  # whatever the user's forward raises on these inputs
        raise ValueError(
            f"--model {args.model!r}: estimating the activations at {at}, its forward raised "
            f"{_one_line(error)}; give them per rank with --activation-memory instead"
        ) from None
    checkpointing = "on" if args.checkpointing else "off"
    said = (
        f"activations estimated from the model at {at} (checkpointing {checkpointing}), "
        f"computing in {compute}: {_gb(estimate.total_bytes)} per rank (saved for backward "
        f"{_gb(estimate.saved_bytes)}, output and its gradient 2 x {_gb(estimate.output_bytes)}, "
        f"recomputed in backward {_gb(estimate.recompute_bytes)})"
    )
    return said, {
        "activations_counted": True,
        "activation_bytes": estimate.total_bytes,
        "activation_source": "estimated",
        "activation_estimate": {
            "batch_size": args.batch,
            "seq_len": args.seq_len,
            "checkpointing": args.checkpointing,
            "dtype": compute,
            "saved_bytes": estimate.saved_bytes,
            "output_bytes": estimate.output_bytes,
            "recompute_bytes": estimate.recompute_bytes,
        },
    }


def _enable_checkpointing(model: nn.Module, target: str) -> None:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if not callable(enable):
        raise ValueError(
            f"--checkpointing: --model {target!r} builds a {type(model).__name__}, which has no "
            f"gradient_checkpointing_enable() (Hugging Face models have it): leave "
            f"--checkpointing out, or give the activations measured under your checkpointing "
            f"with --activation-memory"
        )
    try:
        with warnings.catch_warnings():  # Hugging Face 5.2x: activation_checkpointing_enable
            warnings.simplefilter("ignore", FutureWarning)
            enable()
    except Exception as error:  # e.g. a Hugging Face model that does not support it
        raise ValueError(
            f"--checkpointing: --model {target!r}: {type(model).__name__}"
            f".gradient_checkpointing_enable() raised {_one_line(error)}"
        ) from None


def _memory_per_rank(args: argparse.Namespace) -> tuple[int, int, int | None, str | None]:
    """Device and host memory per rank, as given or detected (see [Note: detected memory per
    rank]), the ranks per node detected host memory was divided by (None where none was), and
    the line reporting what was detected (None where nothing was)."""
    given_device, given_host = args.device_memory, args.host_memory
    if given_device is not None and given_host is not None:
        if args.ranks_per_node is not None:
            raise ValueError(
                "--ranks-per-node divides this host's detected memory, but --device-memory and "
                "--host-memory are both given: leave --ranks-per-node out"
            )
        return given_device, given_host, None, None
    device, host, num_devices, where = _detected_memory()
    if given_host is not None and device is not None:
        # Only the CUDA device's capacity is detected: one rank's own, nothing to divide.
        if args.ranks_per_node is not None:
            raise ValueError(
                "--ranks-per-node divides this host's detected memory, but --host-memory is "
                "given and the device memory is the CUDA device's own: leave --ranks-per-node out"
            )
        return device, given_host, None, (
            f"planning with {where}: device {_gb(device)} per rank (one rank per device; pass "
            f"--device-memory to plan for another device)"
        )  # fmt: skip
    if args.ranks_per_node is not None:
        ranks, rule = args.ranks_per_node, "--ranks-per-node"
        if ranks > args.world_size:
            raise ValueError(f"--ranks-per-node ({ranks}) exceeds --world-size ({args.world_size})")
    elif num_devices:
        ranks = min(args.world_size, num_devices)
        rule = f"one per CUDA device here ({num_devices}), at most --world-size"
    else:
        ranks, rule = args.world_size, "--world-size: without CUDA every rank runs on this host"
    share = host // ranks
    divided = f"this host's {_gb(host)} / {ranks} ranks per node ({rule}) = {_gb(share)} per rank"
    host_memory = share if given_host is None else given_host
    if given_device is not None:
        device_memory, said = given_device, f"host: {divided}"
    elif device is not None:
        device_memory = device
        said = f"device: {_gb(device)} per rank (one rank per device); host: {divided}"
    elif given_host is not None:
        device_memory, said = share, f"device: {divided}"
    else:
        # [Note: detected memory per rank]: the CPU computes from the rank's host share.
        device_memory, said = share, f"device and host: {divided}, counted as both"
    return device_memory, host_memory, ranks, (
        f"planning with {where}: {said} (--ranks-per-node changes the ranks per node; "
        f"--device-memory / --host-memory plan for another machine)"
    )  # fmt: skip


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def _detected_memory() -> tuple[int | None, int, int, str]:
    """This machine's memory: the first CUDA device's capacity (None without CUDA: the CPU
    computes from host memory), the host's memory, the CUDA devices' count, and the name the
    output gives them."""
    import torch

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        name = f"this machine's {properties.name}"
        return int(properties.total_memory), host, torch.cuda.device_count(), name
    return None, host, 0, "this host's memory (no CUDA device: the CPU computes)"


def _consolidate(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.consolidate import consolidate

    try:
        written = consolidate(
            args.source,
            args.target,
            optimizer=not args.weights_only,
            verify_checksums=not args.no_verify,
            progress=lambda line: print(f"shardwise consolidate: {line}", file=sys.stderr),
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
