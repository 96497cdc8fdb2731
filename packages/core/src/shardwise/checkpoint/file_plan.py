"""Which keys go into which file of a sharded checkpoint, and which rank writes each file.

Every rank computes the same plan from the keys' sizes alone (shapes and dtypes are known
everywhere), so the ranks write their files in parallel with no agreement on names, and the
index can be written before any tensor is seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.checkpoint.file_names import shard_file_name


@dataclass(frozen=True, slots=True)
class FilePlan:
    """Attributes:
    files: the keys of every file, in checkpoint order.
    names: every file's name.
    writers: the rank that writes every file.
    sizes: every key's size in bytes.
    """

    files: tuple[tuple[str, ...], ...]
    names: tuple[str, ...]
    writers: tuple[int, ...]
    sizes: dict[str, int]

    def file_of(self) -> dict[str, str]:
        """Key -> the name of its file (an index's `weight_map`)."""
        return {
            key: name for keys, name in zip(self.files, self.names, strict=True) for key in keys
        }

    def files_of_rank(self, rank: int) -> list[int]:
        return [number for number, writer in enumerate(self.writers) if writer == rank]

    @property
    def total_size(self) -> int:
        return sum(self.sizes.values())


def plan_files(
    sizes: Sequence[tuple[str, int]],
    *,
    max_file_bytes: int,
    world_size: int,
    file_name: str | None = None,
    shard_name: str = "",
) -> FilePlan:
    """Split `sizes` (key, bytes), in order, into files of at most `max_file_bytes` (a key
    larger than that gets a file of its own), named by `shard_name` numbering (see
    `file_names.shard_file_name`), and give the ranks runs of consecutive files of about equal
    bytes. With `file_name`, everything goes into that one file, which rank 0 writes.

    Files are also kept to a `world_size`-th of the total: a rank holds the tensors of the file
    it is filling until it is written, so one file holding most of the model (a 500 MB model
    under the default 1024 MB limit) would put it all on one rank, and leave the others idle.
    """
    if max_file_bytes < 1:
        raise ValueError(f"the file size limit must be positive, got {max_file_bytes} bytes")
    by_key = dict(sizes)
    if file_name is not None:
        return FilePlan((tuple(by_key),), (file_name,), (0,), by_key)
    total = sum(by_key.values())
    max_file_bytes = min(max_file_bytes, max(1, -(-total // world_size)))
    files: list[list[str]] = [[]]
    filled = 0
    for key, nbytes in sizes:
        if files[-1] and filled + nbytes > max_file_bytes:
            files.append([])
            filled = 0
        files[-1].append(key)
        filled += nbytes
    if not files[-1]:
        files.pop()
    names = tuple(shard_file_name(shard_name, number) for number in range(1, len(files) + 1))
    file_bytes = [sum(by_key[key] for key in keys) for keys in files]
    return FilePlan(
        tuple(tuple(keys) for keys in files), names, _balanced(file_bytes, world_size), by_key
    )


def _balanced(file_bytes: list[int], world_size: int) -> tuple[int, ...]:
    """Consecutive runs of files, one per rank, each close to an equal share of the bytes:
    file i goes to the rank whose share its middle byte falls into."""
    total = sum(file_bytes) or 1
    writers = []
    before = 0
    for nbytes in file_bytes:
        middle = before + nbytes / 2
        writers.append(min(world_size - 1, int(middle * world_size / total)))
        before += nbytes
    return tuple(writers)
