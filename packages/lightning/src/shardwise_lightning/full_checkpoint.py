"""`state_dict_type="full"`: one ordinary checkpoint file, written by rank 0.

[Note: full checkpoints]
Lightning builds the checkpoint dict before it asks the strategy to save it: the module's
state through `lightning_module_state_dict` (the whole fp32 masters with the module's keys)
and each optimizer's through `optimizer_state`, which under "full" gives the whole optimizer
state in torch's format (numbered by the parameter groups of configure_optimizers, the loss
scaler's state beside it). Both are built on rank 0 alone, as Lightning's FSDPStrategy and
ModelParallelStrategy build theirs: in host memory every rank sends rank 0 the parts of each
tensor its shard holds, received there straight into the tensors of the dict, while the other
ranks allocate nothing and get empty dicts (see [Note: gathering to one rank] in
shardwise/chunk/whole_tensors.py). Rank 0 writes that dict as `shardwise consolidate` lays out
a sharded checkpoint (`lightning_checkpoint`: the scaler under "shardwise") through the
CheckpointIO, whose default writes the file as torch.save serializes it (see [Note: one write
of a checkpoint file] in checkpoint_io.py): every byte of the file is written once into the
dict and once into the file. Rank 0 holds the whole state for the write, as any full-state
save does. One broadcast then tells every rank how the write went, so a path refused or a
write that failed (a full disk) raises on every rank instead of leaving the others waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_fabric.plugins import CheckpointIO

from shardwise.checkpoint.consolidate import WholeCheckpoint, lightning_checkpoint
from shardwise_lightning.checkpoint_io import StreamingCheckpointIO
from shardwise_lightning.checkpoint_paths import (
    full_checkpoint_problem,
    remove_directory,
    remove_sharded_checkpoint,
    sharded_checkpoint_at,
)

LIGHTNING_STATES = ("state_dict", "optimizer_states")


def write_full_checkpoint(
    checkpoint_io: CheckpointIO,
    checkpoint: dict[str, Any],
    path: Path,
    storage_options: Any | None,
) -> None:
    """Rank 0: write Lightning's `checkpoint` dict as one file at `path`, in the place of a
    sharded checkpoint of the same name (see [Note: saving over an earlier checkpoint] in
    checkpoint_paths.py). Raises ValueError for an ordinary directory at `path`."""
    problem = full_checkpoint_problem(path)
    if problem is not None:
        raise ValueError(problem)
    replaced = sharded_checkpoint_at(path)
    renames_over_link = isinstance(checkpoint_io, StreamingCheckpointIO) and storage_options is None
    if replaced is not None and not renames_over_link:
        remove_sharded_checkpoint(path)
    optimizer, scaler = None, None
    if checkpoint.get("optimizer_states"):
        optimizer = dict(checkpoint["optimizer_states"][0])
        scaler = optimizer.pop("loss_scaler", None)
    whole = WholeCheckpoint(
        state_dict=checkpoint["state_dict"],
        optimizer=optimizer,
        grad_scaler=scaler,
        extra={k: v for k, v in checkpoint.items() if k not in LIGHTNING_STATES},
    )
    checkpoint_io.save_checkpoint(
        lightning_checkpoint(whole), path, storage_options=storage_options
    )
    remove_directory(replaced)


def save_on_rank_0(
    path: Path,
    write: Callable[[], None],
    *,
    is_rank_0: bool,
    broadcast: Callable[[Any], Any],
) -> None:
    """Run `write` on rank 0 and raise on every rank if it raised: rank 0 its own error, a
    refused path (ValueError) as a ValueError everywhere, any other failure as a
    RuntimeError naming it. A collective (`broadcast` is the strategy's)."""
    outcome: tuple[str, str] | None = None
    error: Exception | None = None
    if is_rank_0:
        try:
            write()
        except Exception as caught:  # re-raised below, once every rank knows
            error = caught
            kind = "refused" if isinstance(caught, ValueError) else "failed"
            outcome = (kind, f"{type(caught).__name__}: {caught}")
    outcome = broadcast(outcome)
    if error is not None:
        raise error
    if outcome is not None:
        kind, message = outcome
        if kind == "refused":
            raise ValueError(f"rank 0 refused the checkpoint {path}: {message}")
        raise RuntimeError(f"rank 0 could not write the checkpoint {path}: {message}")
