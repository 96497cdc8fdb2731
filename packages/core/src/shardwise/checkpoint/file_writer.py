"""Writing the files of a `FilePlan`, each rank its own, and publishing them together.

[Note: writing a sharded checkpoint]
Values reach a rank in whatever order its source yields them (one gathered chunk at a time
for the engine); a rank keeps only the keys of the files it writes, and writes a file as soon
as all its keys are there, so no rank ever holds more than its files' share. Files are first
written as `<name>.partial`. A write that fails (a full disk) is remembered, not raised: the
rank must go on taking part in its source's collectives, or the other ranks would wait for it
forever. Once the source is exhausted the ranks agree: if any failed, every rank removes its
partial files and raises the same error; else every rank renames its files into place, and
rank 0 removes what is left of an earlier save of the same name and writes the index last.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.checkpoint.commit import Ranks, raise_first, raise_on_every_rank
from shardwise.checkpoint.file_plan import FilePlan

FileFormat = Callable[[dict[str, Any], Path], None]
PARTIAL = ".partial"


class FileWriter:
    """Collects this rank's keys of `plan` and writes each of its files, with `write_file`,
    once complete."""

    def __init__(self, directory: Path, plan: FilePlan, rank: int, write_file: FileFormat) -> None:
        self.directory = directory
        self.plan = plan
        self.write_file = write_file
        self._file_of_key = {
            key: number for number in plan.files_of_rank(rank) for key in plan.files[number]
        }
        self._waiting = {number: set(plan.files[number]) for number in plan.files_of_rank(rank)}
        self._held: dict[int, dict[str, Any]] = {}
        self.partials: list[Path] = []
        self.problem: str | None = None

    def wants(self, key: str) -> bool:
        """Whether this rank writes `key` (so its value need not be made otherwise)."""
        return key in self._file_of_key

    def add(self, key: str, value: Any) -> None:
        """Keep `value` if this rank writes `key`; write its file once complete."""
        number = self._file_of_key.get(key)
        if number is None or self.problem is not None:
            return
        self._held.setdefault(number, {})[key] = value
        self._waiting[number].discard(key)
        if not self._waiting[number]:
            self._write(number)

    def _write(self, number: int) -> None:
        contents = self._held.pop(number)
        ordered = {key: contents[key] for key in self.plan.files[number]}
        partial = self.directory / (self.plan.names[number] + PARTIAL)
        try:
            self.write_file(ordered, partial)
        except (OSError, RuntimeError, ValueError) as error:
            self.problem = f"writing {partial.name}: {type(error).__name__}: {error}"
            partial.unlink(missing_ok=True)
        else:
            self.partials.append(partial)

    def missing(self) -> list[str]:
        """Keys of this rank's files that never came (none once the source is exhausted)."""
        return sorted(key for waiting in self._waiting.values() for key in waiting)


def start_writing(directory: Path, ranks: Ranks) -> None:
    """Create `directory` on rank 0; every rank raises alike if it cannot be."""
    problem = None
    if ranks.rank == 0:
        try:
            if directory.exists() and not directory.is_dir():
                raise ValueError(f"{directory} is a file: give a directory to save into")
            directory.mkdir(parents=True, exist_ok=True)
        except (OSError, ValueError) as error:
            problem = f"{type(error).__name__}: {error}"
    raise_on_every_rank(problem, ranks, "could not create the checkpoint directory")


def publish(
    writer: FileWriter,
    ranks: Ranks,
    *,
    stale: re.Pattern[str] | None = None,
    index: tuple[str, dict[str, Any]] | None = None,
    on_rank_0: Callable[[Path], None] | None = None,
) -> None:
    """After every rank has offered all its values: agree, rename the files into place, and on
    rank 0 remove files matching `stale` that this save did not write, write `index` (its name
    and metadata; the weight map comes from the plan) and call `on_rank_0(directory)`. Raises
    `CheckpointError` on every rank alike if any rank failed."""
    problem = writer.problem
    if problem is None and writer.missing():
        problem = f"keys never reached their file: {writer.missing()[:5]}"
    problems = ranks.all_gather(problem)
    if any(problems):
        for partial in writer.partials:
            partial.unlink(missing_ok=True)
        ranks.barrier()  # so that no rank returns while another still cleans up
        raise_first(problems, "the checkpoint was not saved")
    problem = None
    try:
        for partial in writer.partials:
            os.replace(partial, partial.with_name(partial.name[: -len(PARTIAL)]))
    except OSError as error:
        problem = f"{type(error).__name__}: {error}"
    raise_on_every_rank(problem, ranks, "the checkpoint's files could not be put in place")
    problem = None
    if ranks.rank == 0:
        try:
            _finish_on_rank_0(writer, stale, index, on_rank_0)
        except (OSError, RuntimeError, ValueError) as error:
            problem = f"{type(error).__name__}: {error}"
    raise_on_every_rank(problem, ranks, "the checkpoint's index was not written")


def _finish_on_rank_0(
    writer: FileWriter,
    stale: re.Pattern[str] | None,
    index: tuple[str, dict[str, Any]] | None,
    on_rank_0: Callable[[Path], None] | None,
) -> None:
    directory = writer.directory
    written = set(writer.plan.names)
    if stale is not None:
        for path in directory.iterdir():
            if path.is_file() and path.name not in written and stale.fullmatch(path.name):
                path.unlink()
    if index is not None:
        name, metadata = index
        contents = {
            "metadata": {**metadata, "total_size": writer.plan.total_size},
            "weight_map": writer.plan.file_of(),
        }
        partial = directory / (name + PARTIAL)
        partial.write_text(json.dumps(contents, indent=2))
        os.replace(partial, directory / name)
    if on_rank_0 is not None:
        on_rank_0(directory)
