"""DiskPool on one process: bytes round-trip exactly in every dtype, a write frees the tensors'
memory and a read gives it back, only a commit makes a written copy the one read, a failed
write leaves the tensors as they were, and the files go when the pool is closed (see [Note:
the disk tier] in memory/disk_pool.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.memory import disk_pool
from shardwise.memory.disk_pool import DiskPool


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(1000),
        torch.randn(333).to(torch.bfloat16),
        torch.randn(17).to(torch.float16),
        torch.zeros(0),
        torch.tensor([float("inf"), float("nan"), -0.0]),
    ]


def test_bytes_round_trip_and_memory_is_freed_then_given_back(tmp_path: Path) -> None:
    pool = DiskPool(tmp_path, rank=3)
    assert pool.path.parent == tmp_path and pool.path.name.startswith("shardwise-rank3-")
    tensors = _tensors()
    expected = [t.clone() for t in tensors]
    pool.write(7, tensors).result()
    assert all(t.untyped_storage().size() == 0 for t in tensors)
    assert not pool.holds(7)  # written, not committed
    pool.commit([7])
    assert pool.holds(7)
    assert pool.stored_bytes(7) == sum(t.numel() * t.element_size() for t in expected)
    pool.read(7, tensors).result()
    for got, want in zip(tensors, expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # nan and -0.0 too
    assert pool.bytes_written == pool.bytes_read == pool.stored_bytes(7)


def test_only_a_commit_makes_a_written_copy_the_one_read(tmp_path: Path) -> None:
    pool = DiskPool(tmp_path, rank=0)
    first = [torch.arange(10.0)]
    pool.write(0, first).result()
    pool.commit([0])
    pool.read(0, first).result()
    first[0].add_(100)
    pool.write(0, first).result()  # into the other slot
    pool.discard([0])  # a step rolled back: the first copy is still the current one
    pool.read(0, first).result()
    assert torch.equal(first[0], torch.arange(10.0))
    first[0].add_(1)
    pool.write(0, first).result()
    pool.commit([0])
    pool.read(0, first).result()
    assert torch.equal(first[0], torch.arange(10.0) + 1)


def test_a_failed_write_leaves_the_tensors_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = DiskPool(tmp_path, rank=0)
    tensor = torch.arange(5.0)
    pool.write(1, [tensor]).result()
    pool.commit([1])
    pool.read(1, [tensor]).result()
    tensor.add_(1)

    def full(path: Path, buffers: list[memoryview], *, write: bool) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_pool, "_transfer", full)
    with pytest.raises(OSError, match="No space left"):
        pool.write(1, [tensor]).result()
    assert torch.equal(tensor, torch.arange(5.0) + 1)  # nothing lost
    monkeypatch.undo()
    pool.read(1, [tensor]).result()  # the committed copy is intact
    assert torch.equal(tensor, torch.arange(5.0))


def test_reading_tensors_of_another_size_than_written_is_refused(tmp_path: Path) -> None:
    pool = DiskPool(tmp_path, rank=0)
    pool.write(2, [torch.zeros(4)]).result()
    pool.commit([2])
    with pytest.raises(RuntimeError, match="not those written"):
        pool.read(2, [torch.zeros(5)])
    with pytest.raises(RuntimeError, match="no copy on the disk tier"):
        pool.read(3, [torch.zeros(4)])


def test_files_are_removed_on_close_and_when_the_pool_is_collected(tmp_path: Path) -> None:
    pool = DiskPool(tmp_path, rank=0)
    pool.write(0, [torch.ones(3)]).result()
    pool.commit([0])
    path = pool.path
    assert any(path.iterdir())
    pool.close()
    assert not path.exists() and pool.closed
    again = DiskPool(tmp_path, rank=0)
    again.write(0, [torch.ones(3)]).result()
    path = again.path
    del again
    import gc

    gc.collect()
    assert not path.exists()


def test_a_directory_that_cannot_hold_files_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="cannot hold files"):
        DiskPool(blocker / "below", rank=0)


def test_files_are_removed_when_the_process_exits(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from shardwise.memory.disk_pool import DiskPool\n"
        "pool = DiskPool(sys.argv[1], rank=0)\n"
        "pool.write(0, [torch.ones(8)]).result()\n"
        "print(pool.path)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmp_path))
    assert not any(tmp_path.iterdir())
