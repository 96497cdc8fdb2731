"""Atomic publication and verification of a checkpoint directory.

[Note: atomic checkpoints]
A save writes into a fresh directory `<name>.<token>` beside the target, then rank 0 writes a
manifest (every file with its size and SHA-256) and swaps the symlink `<name>` to point at the
new directory with one rename, which is atomic on POSIX file systems. Until that rename the
symlink still points at the previous checkpoint, complete; after it, at the new one, complete.
A crash at any point therefore leaves a whole checkpoint behind, never a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

MANIFEST = "manifest.json"
FORMAT = "shardwise-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or belongs to another model."""


def check_save_target(path: Path) -> None:
    """Refuse, on every rank alike and before anything is written, a `path` that exists and
    is not a checkpoint link (an ordinary directory or file would never be replaced)."""
    problem = None
    if (path.exists() or path.is_symlink()) and not path.is_symlink():
        kind = "directory" if path.is_dir() else "file"
        problem = (
            f"{path} exists and is an ordinary {kind}, not a shardwise checkpoint link: save to "
            f"another path, or remove it first"
        )
    _raise_on_every_rank(problem)


def remove_unfinished_versions(path: Path) -> None:
    """Rank 0 drops the directories of saves to `path` that were killed before publishing
    (see [Note: atomic checkpoints]); the published one, if any, is kept."""
    if _rank() == 0:
        current = path.resolve() if path.is_symlink() else None
        for stale in path.parent.glob(f"{path.name}.*"):
            unfinished = stale.is_dir() and not stale.is_symlink() and _is_version_of(path, stale)
            if unfinished and (current is None or stale.resolve() != current):
                shutil.rmtree(stale, ignore_errors=True)


def new_version_dir(path: Path) -> Path:
    """A fresh directory beside `path` for this save, the same on every rank."""
    token = [secrets.token_hex(6) if _rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    version = path.parent / f"{path.name}.{token[0]}"
    if _rank() == 0:
        version.mkdir(parents=True)
    _barrier()
    return version


def sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest_and_commit(path: Path, version: Path, description: dict[str, Any]) -> None:
    """Hash the files (each rank its share), then on rank 0 write the manifest and publish."""
    _barrier()
    files = sorted(p.name for p in version.iterdir() if p.is_file())
    mine = {
        name: _file_entry(version / name) for i, name in enumerate(files) if i % _world() == _rank()
    }
    entries: dict[str, Any] = {}
    for part in _all_gather(mine):
        entries.update(part)
    if _rank() == 0:
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "files": entries, **description}
        temporary = version / f".{MANIFEST}.tmp"
        with temporary.open("w") as handle:
            json.dump(manifest, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, version / MANIFEST)
        _publish(path, version)
    _barrier()


def _file_entry(file: Path) -> dict[str, Any]:
    return {"bytes": file.stat().st_size, "sha256": sha256(file)}


def _publish(path: Path, version: Path) -> None:
    if path.exists() and not path.is_symlink():
        raise CheckpointError(
            f"{path} exists and is not a shardwise checkpoint link; choose another path or "
            f"remove it"
        )
    previous = path.resolve() if path.is_symlink() else None
    link = path.parent / f".{path.name}.link-{secrets.token_hex(4)}"
    os.symlink(version.name, link)
    os.replace(link, path)  # see [Note: atomic checkpoints]
    _fsync_dir(path.parent)
    if previous is not None and previous != version.resolve() and previous.is_dir():
        shutil.rmtree(previous, ignore_errors=True)
    remove_unfinished_versions(path)


def _is_version_of(path: Path, candidate: Path) -> bool:
    suffix = candidate.name[len(path.name) + 1 :]
    return len(suffix) == 12 and all(c in "0123456789abcdef" for c in suffix)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, or a CheckpointError saying what is wrong."""
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(
            f"{path} has no {MANIFEST}: it is not a shardwise checkpoint, or its save never "
            f"finished"
        )
    try:
        manifest: dict[str, Any] = json.loads(manifest_file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{manifest_file} is corrupted: {error}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a shardwise checkpoint (format {manifest.get('format')!r})"
        )
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {manifest.get('version')}, this shardwise reads "
            f"version {FORMAT_VERSION}"
        )
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], *, collective: bool = True) -> None:
    """Check every file's size and checksum, each rank a share, and raise the same error on
    every rank (naming the first bad file) so no rank is left waiting in a collective. With
    `collective=False` this process checks every file alone (one rank reading a checkpoint)."""
    names = sorted(manifest["files"])
    problem: tuple[int, str] | None = None
    rank, world = (_rank(), _world()) if collective else (0, 1)
    for i, name in enumerate(names):
        if i % world != rank:
            continue
        expected = manifest["files"][name]
        file = path / name
        if not file.is_file():
            problem = (i, f"{file} is missing")
        elif file.stat().st_size != expected["bytes"]:
            size = file.stat().st_size
            problem = (i, f"{file} has {size} bytes, the manifest says {expected['bytes']}")
        elif sha256(file) != expected["sha256"]:
            problem = (i, f"{file} is corrupted: its SHA-256 differs from the manifest's")
        if problem:
            break
    problems = sorted(p for p in (_all_gather(problem) if collective else [problem]) if p)
    if problems:
        raise CheckpointError(problems[0][1])


def _raise_on_every_rank(problem: str | None) -> None:
    """Raise the lowest rank's problem on every rank, or return on every rank."""
    found = [p for p in _all_gather(problem) if p]
    if found:
        raise CheckpointError(found[0])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
