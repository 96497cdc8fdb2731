"""The strategies' default CheckpointIO: Lightning's `TorchCheckpointIO`, writing local files
as `torch.save` serializes them.

[Note: one write of a checkpoint file]
Lightning's `TorchCheckpointIO` serializes the whole checkpoint into an in-memory buffer and
then writes that buffer out (through fsspec, from a temporary file in the system's temporary
directory), so a 1.4 GB checkpoint is copied twice and held twice at its peak. For a local path
this class hands `torch.save` the open file instead: each tensor's bytes go from its storage to
the file once, and the file holds exactly the bytes Lightning's would (the same serializer over
a file object, the same archive name). The file is written beside the target under a hidden
name and renamed over it, so a crash leaves the previous checkpoint, as Lightning's atomic save
does. Remote file systems, `storage_options`, and loading are Lightning's own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning_fabric.plugins import TorchCheckpointIO

from shardwise_lightning.namespace import describe


class StreamingCheckpointIO(TorchCheckpointIO):
    """Lightning's `TorchCheckpointIO` that writes a checkpoint for the local file system
    straight from `torch.save` into the file, once (see [Note: one write of a checkpoint
    file]); files are the same as Lightning's. The shardwise strategies use it unless given
    a `checkpoint_io` (or a CheckpointIO plugin)."""

    def __repr__(self) -> str:
        return describe(self)

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Write `checkpoint` at the local path `path`: beside it under a hidden name, then
        renamed over it. URLs (`s3://...`, `file://...`) and `storage_options` go to
        `TorchCheckpointIO`."""
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, os.fspath(path), storage_options=storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.partial")
        try:
            with open(partial, "wb") as file:
                torch.save(checkpoint, file)
            os.replace(partial, target)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
