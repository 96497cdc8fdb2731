"""The engine's memory (memory/): pinned host buffers pooled by size class, freed by use count
and by their copy's completion; the one copy path; streams and pending work on a CPU.

Pinning is a `Pinner` the pool is given: on this CPU host a fake one that records what it
pinned, so the pool's logic runs exactly as it does over cudaHostRegister."""

from __future__ import annotations

import pytest
import torch

from shardwise.memory import Done, Memory, PendingCopy, PinnedBuffers, Streams
from shardwise.memory.buffer_pool import size_class


class CountingPinner:
    """Records the storages pinned and unpinned, by address."""

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}  # data_ptr -> bytes
        self.pins = 0
        self.unpins = 0

    def pin(self, storage: torch.UntypedStorage) -> None:
        assert storage.nbytes() > 0, "cudaHostRegister refuses zero bytes"
        assert storage.data_ptr() not in self.pinned, "pinned twice"
        self.pinned[storage.data_ptr()] = storage.nbytes()
        self.pins += 1

    def unpin(self, storage: torch.UntypedStorage) -> None:
        assert storage.data_ptr() in self.pinned, "unpinned what was not pinned"
        del self.pinned[storage.data_ptr()]
        self.unpins += 1


MB = 1 << 20


def test_a_dropped_buffer_serves_the_next_of_its_size_class_without_pinning_again() -> None:
    pinner = CountingPinner()
    pool = PinnedBuffers(pinner, spare_limit_bytes=64 * MB)
    first = pool.empty(1_000_000, torch.float32)
    address = first.data_ptr()
    assert pinner.pins == 1 and first.numel() == 1_000_000
    del first  # the only view: the buffer is free again
    second = pool.empty(1_000_100, torch.float32)  # a few elements more: the same class
    assert second.data_ptr() == address
    assert pinner.pins == 1 and pool.reused == 1


def test_a_buffer_still_viewed_is_not_handed_out_again() -> None:
    pinner = CountingPinner()
    pool = PinnedBuffers(pinner, spare_limit_bytes=64 * MB)
    first = pool.empty(500_000, torch.float32)
    view = first[10:20]  # e.g. a parameter's slice kept by the optimizer
    del first
    second = pool.empty(500_000, torch.float32)
    assert second.data_ptr() != view.data_ptr() - 10 * 4
    assert pinner.pins == 2


def test_a_buffer_is_not_reused_before_its_copy_completes() -> None:
    pinner = CountingPinner()
    pool = PinnedBuffers(pinner, spare_limit_bytes=64 * MB)
    buffer = pool.empty(300_000, torch.float32)
    address = buffer.data_ptr()
    completed = [False]
    pool.note_copy(buffer, lambda: completed[0])
    del buffer
    other = pool.empty(300_000, torch.float32)
    assert other.data_ptr() != address  # the copy still reads it
    del other
    completed[0] = True
    assert pool.empty(300_000, torch.float32).data_ptr() == address
    assert pinner.pins == 2


def test_free_buffers_beyond_the_limit_are_unpinned_and_drain_unpins_the_rest() -> None:
    pinner = CountingPinner()
    pool = PinnedBuffers(pinner, spare_limit_bytes=size_class(8 * MB))
    big = pool.empty(2 * MB, torch.float32)  # 8 MiB
    del big
    assert pool.spare_bytes == size_class(8 * MB)
    small = pool.empty(MB, torch.float16)  # another class: pins; the big one is within limit
    assert pinner.unpins == 0
    pool.spare_limit_bytes = 0
    other = pool.empty(MB // 2, torch.float16)  # pinning more: free buffers over the limit go
    assert pinner.unpins == 1 and pool.spare_bytes == 0
    del small, other
    pool.drain()
    assert pinner.pinned == {} and pool.pinned_bytes == 0


def test_a_step_of_host_copies_pins_nothing_after_the_first() -> None:
    """The shape of an offloaded step: per chunk a reduced gradient copied to the host and
    an updated shard copied back, each a temporary the next step's copies reuse."""
    pinner = CountingPinner()
    memory = Memory(torch.device("cpu"), pinned=PinnedBuffers(pinner))
    memory.keep_room_for([4 * 200_000, 4 * 300_000])
    shards = [torch.randn(200_000), torch.randn(300_000)]
    for step in range(4):
        for shard in shards:
            pending = memory.start_copy(shard, to_host=True)
            assert torch.equal(pending.wait(), shard)
        if step == 0:
            pins_after_first_step = pinner.pins
    assert pinner.pins == pins_after_first_step == 2


def test_the_copy_path_casts_and_counts_nothing_on_its_own() -> None:
    memory = Memory(torch.device("cpu"))
    source = torch.randn(1000)
    pending = memory.start_copy(source, to_host=False, dtype=torch.bfloat16)
    copied = pending.wait()
    assert pending.done
    assert copied.dtype is torch.bfloat16 and torch.equal(copied, source.to(torch.bfloat16))
    assert copied.data_ptr() != source.data_ptr()


def test_no_streams_on_a_cpu_and_pending_work_is_done() -> None:
    streams = Streams(torch.device("cpu"))
    assert not streams.enabled
    assert streams.record() is None
    streams.wait(None)
    with streams.on(streams.copy):
        pass
    assert Done(3).wait() == 3
    tensor = torch.ones(2)
    assert PendingCopy(tensor).wait() is tensor


def test_memory_refuses_a_host_buffer_pool_for_a_cuda_device() -> None:
    from shardwise.memory import BufferPool

    with pytest.raises(ValueError, match="serves a CPU device"):
        Memory(torch.device("cuda", 0), pooled=BufferPool(0))


def test_an_empty_buffer_is_not_pinned() -> None:
    pinner = CountingPinner()
    pool = PinnedBuffers(pinner)
    empty = pool.empty(0, torch.float32)
    assert empty.numel() == 0 and empty.dtype == torch.float32
    assert pinner.pins == 0 and not pool.owns(empty)


def test_a_dropped_pool_unpins_every_buffer_in_use_or_not() -> None:
    # Else the memory is freed still registered, and the allocator hands its addresses to
    # the next model, whose registration CUDA refuses.
    pinner = CountingPinner()
    pool = PinnedBuffers(pinner, spare_limit_bytes=64 * MB)
    in_use = pool.empty(1000, torch.float32)
    free = pool.empty(5000, torch.float32)
    del free
    assert pinner.pins == 2 and pinner.unpins == 0
    del pool
    assert pinner.unpins == 2 and not pinner.pinned
    in_use.fill_(1.0)  # a tensor still viewing it keeps its (now pageable) memory


def test_the_host_waits_for_a_copy_still_reading_a_buffer_before_writing_it() -> None:
    pool = PinnedBuffers(CountingPinner())
    buffer = pool.empty(1000, torch.float32)
    waited: list[str] = []
    memory = Memory(torch.device("cpu"), pinned=pool)
    pool.note_copy(buffer, lambda: False, lambda: waited.append("copy"))
    memory.before_host_write(buffer)
    assert waited == ["copy"]
    pool.note_copy(buffer, lambda: True, lambda: waited.append("done already"))
    memory.before_host_write(buffer)
    assert waited == ["copy"]  # a completed copy is not waited for
