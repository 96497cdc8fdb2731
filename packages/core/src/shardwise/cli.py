"""The `shardwise` command: `shardwise plan ...` predicts memory and recommends a configuration;
`shardwise consolidate SRC DST` writes a sharded checkpoint as one file.

This module builds the parser and dispatches; each sub-command lives in shardwise/subcommands/.
Nothing it imports imports torch, so that `shardwise --version` and `--help` answer at once.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from shardwise.subcommands import consolidate, plan

# The command line's value readers stay importable from here, where they were first public.
from shardwise.subcommands.arguments import count, size_in_bytes, size_in_bytes_or_zero

__all__ = ["count", "main", "size_in_bytes", "size_in_bytes_or_zero"]


def main(argv: list[str] | None = None) -> int:
    """Run `shardwise plan` or `shardwise consolidate` on `argv` (default: the command line).

    Returns the exit status: for `plan` 0 when a configuration fits and 1 when none does (the
    output printed all the same); usage errors exit with 2 through argparse.
    """
    parser, planner = _parser()
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        return consolidate.run(args)
    try:
        return plan.run(args)
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
    """The `shardwise` parser, and its `plan` sub-parser, through which plan's refusals exit."""
    parser = argparse.ArgumentParser(prog="shardwise")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)
    planner = plan.add_parser(commands)
    consolidate.add_parser(commands)
    return parser, planner


if __name__ == "__main__":
    sys.exit(main())
