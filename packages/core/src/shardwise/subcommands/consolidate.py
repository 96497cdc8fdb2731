"""`shardwise consolidate SRC DST`: a sharded checkpoint written as one file that
load_from_checkpoint and torch.load read without shardwise."""

from __future__ import annotations

import argparse
import sys


def add_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add `consolidate` and its options to `commands` (the subparsers of `shardwise`)."""
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
    return merger


def run(args: argparse.Namespace) -> int:
    """Write args.source as args.target, report what was written, and return 0; a checkpoint
    that cannot be read is reported on stderr and returns 2."""
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
