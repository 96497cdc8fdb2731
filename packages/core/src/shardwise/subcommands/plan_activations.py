"""`shardwise plan`'s activations per rank: given (--activation-memory), estimated from --model
at --batch x --seq-len (with --checkpointing, under activation checkpointing), or not counted;
the options' refusals, the line saying which, and the JSON's fields for them."""

from __future__ import annotations

import argparse
import warnings
from typing import TYPE_CHECKING, Any

from shardwise.subcommands.arguments import DTYPES, gb
from shardwise.subcommands.plan_model import MODEL_FORM, one_line

if TYPE_CHECKING:
    from torch import nn


def check_activation_options(args: argparse.Namespace) -> None:
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
            f"({MODEL_FORM}), or give the activations' bytes per rank with --activation-memory"
        )
    if args.checkpointing and not estimate:
        raise ValueError(
            "--checkpointing applies to the estimate: give --model with --batch and --seq-len "
            "(with --activation-memory, give the bytes measured under checkpointing)"
        )


def given_activations(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
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
        said = f"activations as given (--activation-memory): {gb(args.activation_memory)} per rank"
    return said, {
        "activations_counted": args.activation_memory is not None,
        "activation_bytes": args.activation_memory or 0,
        "activation_source": "none" if args.activation_memory is None else "given",
        "activation_estimate": None,
    }


def estimated_activations(args: argparse.Namespace, model: nn.Module) -> tuple[str, dict[str, Any]]:
    """The activations estimated from `model` (on the meta device) at --batch x --seq-len: the
    line saying so and the JSON's fields, the estimate's parts included."""
    import torch

    from shardwise.planner import estimate_token_activation_bytes

    # A step's activations are in the dtype its forward computes in.
    compute = args.compute_dtype or args.dtype
    model.to(getattr(torch, DTYPES[compute])).train()
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
            f"{one_line(error)}; give them per rank with --activation-memory instead"
        ) from None
    checkpointing = "on" if args.checkpointing else "off"
    said = (
        f"activations estimated from the model at {at} (checkpointing {checkpointing}), "
        f"computing in {compute}: {gb(estimate.total_bytes)} per rank (saved for backward "
        f"{gb(estimate.saved_bytes)}, output and its gradient 2 x {gb(estimate.output_bytes)}, "
        f"recomputed in backward {gb(estimate.recompute_bytes)})"
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
            f".gradient_checkpointing_enable() raised {one_line(error)}"
        ) from None
