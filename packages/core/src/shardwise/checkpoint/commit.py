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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed import ProcessGroup

from shardwise import comm
from shardwise.comm import CommStats

MANIFEST = "manifest.json"
FORMAT = "shardwise-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or belongs to another model."""


@dataclass(frozen=True, slots=True)
class Ranks:
    """The ranks taking part in a save or load (the model's group), and the counters their
    agreements are recorded in; `Ranks.alone()` is one process reading by itself."""

    stats: CommStats
    group: ProcessGroup | None = None
    collective: bool = True

    @classmethod
    def alone(cls) -> Ranks:
        return cls(CommStats(), None, collective=False)

    @property
    def rank(self) -> int:
        return comm.rank(self.group) if self.collective else 0

    @property
    def world(self) -> int:
        return comm.world_size(self.group) if self.collective else 1

    def barrier(self) -> None:
        if self.collective:
            comm.barrier(self.stats, self.group)

    def all_gather(self, value: Any) -> list[Any]:
        if not self.collective:
            return [value]
        return comm.all_gather_object(value, self.stats, self.group)

    def from_first(self, value: Any) -> Any:
        """The value of the group's first rank, on every rank."""
        if not self.collective:
            return value
        return comm.broadcast_object(value, self.stats, self.group)


def check_save_target(path: Path, ranks: Ranks, *, replace_file: bool = False) -> None:
    """Refuse, on every rank alike and before anything is written, a `path` that exists and
    is not a checkpoint link: an ordinary directory is never replaced, an ordinary file only
    with `replace_file` (when the new checkpoint is published, atomically)."""
    problem = None
    if path.exists() and not path.is_symlink() and not (replace_file and path.is_file()):
        kind = "directory" if path.is_dir() else "file"
        problem = (
            f"{path} exists and is an ordinary {kind}, not a shardwise checkpoint link: save to "
            f"another path, or remove it first"
        )
    raise_on_every_rank(problem, ranks)


def remove_unfinished_versions(path: Path, ranks: Ranks) -> None:
    """Rank 0 drops the directories of saves to `path` that were killed before publishing
    (see [Note: atomic checkpoints]); the published one, if any, is kept."""
    if ranks.rank == 0:
        current = path.resolve() if path.is_symlink() else None
        for stale in path.parent.glob(f"{path.name}.*"):
            unfinished = stale.is_dir() and not stale.is_symlink() and _is_version_of(path, stale)
            if unfinished and (current is None or stale.resolve() != current):
                shutil.rmtree(stale, ignore_errors=True)


def new_version_dir(path: Path, ranks: Ranks) -> Path:
    """A fresh directory beside `path` for this save, the same on every rank."""
    token = ranks.from_first(secrets.token_hex(6) if ranks.rank == 0 else None)
    version = path.parent / f"{path.name}.{token}"
    if ranks.rank == 0:
        version.mkdir(parents=True)
    ranks.barrier()
    return version


def sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest_and_commit(
    path: Path,
    version: Path,
    description: dict[str, Any],
    ranks: Ranks,
    *,
    replace_file: bool = False,
) -> None:
    """Hash the files (each rank its share), then on rank 0 write the manifest and publish
    (over an ordinary file at `path` only with `replace_file`)."""
    ranks.barrier()
    files = sorted(p.name for p in version.iterdir() if p.is_file())
    rank, world = ranks.rank, ranks.world
    mine = {name: _file_entry(version / name) for i, name in enumerate(files) if i % world == rank}
    entries: dict[str, Any] = {}
    for part in ranks.all_gather(mine):
        entries.update(part)
    if rank == 0:
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "files": entries, **description}
        temporary = version / f".{MANIFEST}.tmp"
        with temporary.open("w") as handle:
            json.dump(manifest, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, version / MANIFEST)
        _publish(path, version, ranks, replace_file=replace_file)
    ranks.barrier()


def _file_entry(file: Path) -> dict[str, Any]:
    return {"bytes": file.stat().st_size, "sha256": sha256(file)}


def _publish(path: Path, version: Path, ranks: Ranks, *, replace_file: bool) -> None:
    if path.exists() and not path.is_symlink() and not (replace_file and path.is_file()):
        raise CheckpointError(
            f"{path} exists and is not a shardwise checkpoint link; choose another path or "
            f"remove it"
        )
    previous = path.resolve() if path.is_symlink() else None
    link = path.parent / f".{path.name}.link-{secrets.token_hex(4)}"
    os.symlink(version.name, link)
    os.replace(link, path)  # see [Note: atomic checkpoints]; replaces a file as well
    _fsync_dir(path.parent)
    if previous is not None and previous != version.resolve() and previous.is_dir():
        shutil.rmtree(previous, ignore_errors=True)
    remove_unfinished_versions(path, ranks)


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


def verify_files(path: Path, manifest: dict[str, Any], ranks: Ranks) -> None:
    """Check every file's size and checksum, each rank a share, and raise the same error on
    every rank (naming the first bad file) so no rank is left waiting in a collective. With
    `Ranks.alone()` this process checks every file itself (one rank reading a checkpoint)."""
    names = sorted(manifest["files"])
    problem: tuple[int, str] | None = None
    rank, world = ranks.rank, ranks.world
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
    problems = sorted(p for p in ranks.all_gather(problem) if p)
    if problems:
        raise CheckpointError(problems[0][1])


def raise_on_every_rank(problem: str | None, ranks: Ranks, what: str | None = None) -> None:
    """Raise the lowest rank's problem on every rank, or return on every rank."""
    raise_first(ranks.all_gather(problem), what)


def raise_first(problems: list[str | None], what: str | None = None) -> None:
    """Raise `CheckpointError` with the first problem of `problems` (one per rank, in rank
    order), after `what` and naming its rank when `what` is given; return if there is none."""
    for rank, problem in enumerate(problems):
        if problem:
            raise CheckpointError(f"{what}: {problem} (rank {rank})" if what else problem)
