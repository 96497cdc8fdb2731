"""What is at a checkpoint's path before the strategies save there, and what they remove.

[Note: saving over an earlier checkpoint]
`ModelCheckpoint` saves `last.ckpt` again and again, and a run resumed with the other
`state_dict_type` saves over a checkpoint of the other form. As with Lightning's
FSDPStrategy, either form takes the other's place: a full checkpoint (one file) replaces a
sharded one (a link to a directory), and a sharded checkpoint replaces a file. Both are
atomic with the default CheckpointIO: the new checkpoint is renamed over the old name (a file
over the link, or the link over the file), so a crash leaves the old checkpoint; only then is
the old sharded checkpoint's directory removed. A CheckpointIO of the user's, or a write with
`storage_options`, would write through the link into the directory, so there the sharded
checkpoint is removed first. An ordinary directory at the path is never replaced: every rank
refuses it alike, before anything is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

MANIFEST = "manifest.json"


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether `path` names a shardwise sharded checkpoint (one with its manifest)."""
    return path.is_dir() and (path / MANIFEST).is_file()


def sharded_checkpoint_at(path: Path) -> Path | None:
    """The directory of the sharded checkpoint whose link is `path`, if it is one."""
    if path.is_symlink() and is_sharded_checkpoint(path):
        return path.resolve()
    return None


def full_checkpoint_problem(path: Path) -> str | None:
    """Why a full checkpoint (one file) cannot be written at `path`, or None."""
    if path.is_dir() and sharded_checkpoint_at(path) is None:
        return (
            f"cannot write the checkpoint file {path}: it is an ordinary directory, not a "
            f"checkpoint; pass a file path (e.g. {path / 'last.ckpt'}), or remove the directory"
        )
    return None


def remove_sharded_checkpoint(path: Path) -> None:
    """Remove a sharded checkpoint: its link and the version directory it names."""
    if not path.is_symlink():
        return
    target = path.resolve()
    path.unlink()
    remove_directory(target)


def remove_directory(directory: Path | None) -> None:
    """Remove what a replaced sharded checkpoint left (nothing when it is already gone)."""
    if directory is not None and directory.is_dir() and not directory.is_symlink():
        shutil.rmtree(directory, ignore_errors=True)
