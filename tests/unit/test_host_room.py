"""The host's room (see [Note: the host's room] in memory/host_room.py): a host buffer that
would leave the host less than its reserve is refused with the figures and the fix, before
it is allocated; pooled pinned buffers are checked only when a new one is pinned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.memory import Memory, PinnedBuffers
from shardwise.memory.host_room import HostMemoryExhausted, HostRoom, available_host_bytes

GiB = 1 << 30


class Pinner:
    def pin(self, storage: torch.UntypedStorage) -> None:
        pass

    def unpin(self, storage: torch.UntypedStorage) -> None:
        pass


def test_the_kernels_figure_is_read_in_bytes(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemAvailable:    2048 kB\n")
    assert available_host_bytes(meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    assert available_host_bytes(meminfo) is None
    assert available_host_bytes(tmp_path / "missing") is None


def test_a_buffer_leaving_less_than_the_reserve_is_refused_with_the_fix() -> None:
    room = HostRoom(reserve_bytes=2 * GiB, available=lambda: 10 * GiB)
    room.check(8 * GiB)  # leaves exactly the reserve
    with pytest.raises(HostMemoryExhausted) as raised:
        room.check(9 * GiB)
    message = str(raised.value)
    assert "1.00 GiB short" in message and "10.00 GiB available" in message
    assert "activation checkpointing" in message and "nvme_offload_fraction" in message
    HostRoom(available=lambda: None).check(10**15)  # nothing known, nothing refused


def test_plain_host_buffers_are_checked_and_pooled_pinned_ones_only_when_new() -> None:
    checked: list[int] = []

    def available() -> int:
        checked.append(1)
        return 64 * GiB

    room = HostRoom(reserve_bytes=0, available=available)
    plain = Memory(torch.device("cpu"), host_room=room)
    plain.empty(1000, torch.float32, host=True)
    plain.empty(1000, torch.float32, host=True)
    assert len(checked) == 2
    checked.clear()
    pinned = Memory(torch.device("cpu"), pinned=PinnedBuffers(Pinner(), room=room))
    for _ in range(3):
        pinned.empty(1000, torch.float32, host=True)  # dropped at once: the pool reuses it
    assert len(checked) == 1
    starved = Memory(
        torch.device("cpu"), host_room=HostRoom(reserve_bytes=GiB, available=lambda: GiB)
    )
    with pytest.raises(HostMemoryExhausted):
        starved.empty(1000, torch.float32, host=True)
    starved.empty(1000, torch.float32)  # the device's buffers are not the host's concern
