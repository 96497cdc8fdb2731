"""The pool of host buffers (see [Note: a pool of host buffers] in memory/buffer_pool.py): memory
moves between storage objects, so views of an emptied buffer see it empty and those of a
refilled one see it again; a buffer another tensor views is never taken; the spare limit
holds; and the configuration decides where a pool applies."""

from __future__ import annotations

import sys

import pytest
import torch

from shardwise import zero_model_wrapper
from shardwise.engine.config import EngineConfig, Placement
from shardwise.gemini import placement_policy
from shardwise.host_memory import kernel_grants_huge_pages
from shardwise.memory.buffer_pool import BufferPool, pool_supported, size_class
from shardwise.memory.pages import advise_huge_pages

needs_pool = pytest.mark.skipif(not pool_supported(), reason="this torch cannot move memory")


@needs_pool
def test_a_freed_buffer_serves_the_next_of_its_size_through_the_same_storage() -> None:
    pool = BufferPool(1 << 20)
    payload = torch.arange(1024.0)
    view = payload[10:20]  # a parameter viewing its place in the payload
    address = payload.data_ptr()
    pool.free(payload)
    assert (payload.untyped_storage().nbytes(), pool.spare_bytes) == (0, 4096)
    assert view.untyped_storage().nbytes() == 0  # the view sees it empty, as after resize_(0)
    pool.fill(payload)
    assert payload.data_ptr() == address and pool.reused == 1 and pool.spare_bytes == 0
    assert torch.equal(view, torch.arange(10.0, 20.0))  # the same memory, not yet rewritten
    pool.free(payload)
    grads = pool.empty(1024, torch.float32)
    assert (grads.shape, grads.data_ptr(), pool.reused) == ((1024,), address, 2)
    # Another size comes from the allocator.
    other = pool.empty(10, torch.float32)
    assert other.shape == (10,) and pool.reused == 2


@needs_pool
def test_a_buffer_another_tensor_views_is_not_taken_back() -> None:
    pool = BufferPool(1 << 20)
    grads = torch.ones(256)
    shown = grads[:8]  # `.grad` viewing it
    pool.give_back(grads)
    assert pool.spare_bytes == 0 and torch.equal(shown, torch.ones(8))
    del shown
    pool.give_back(grads)
    assert pool.spare_bytes == 1024 and grads.untyped_storage().nbytes() == 0


@needs_pool
def test_the_spare_limit_holds_and_drain_frees_everything() -> None:
    pool = BufferPool(0)
    pool.keep_room_for([4096, 1024])
    assert pool.spare_limit_bytes == 8192
    buffers = [torch.ones(1024) for _ in range(3)]
    for buffer in buffers:
        pool.free(buffer)
    assert pool.spare_bytes == 8192  # the third went back to the allocator
    assert all(b.untyped_storage().nbytes() == 0 for b in buffers)
    pool.drain()
    assert pool.spare_bytes == 0 and pool.empty(1024, torch.float32).shape == (1024,)
    assert pool.reused == 0
    with pytest.raises(ValueError, match="spare_limit_bytes must be >= 0"):
        BufferPool(-1)


def _config(**placement: object) -> EngineConfig:
    policy = placement.pop("policy", "cuda")
    return EngineConfig(
        stage=3,
        device=torch.device("cpu"),
        placement=Placement(policy=placement_policy(str(policy)), **placement),  # type: ignore[arg-type]
    )


@needs_pool
def test_the_pool_is_on_request_and_refused_under_a_budget() -> None:
    assert not _config().pools_host_buffers
    assert _config(host_buffer_pool=True).pools_host_buffers
    assert _config(policy="cpu", host_buffer_pool=True).pools_host_buffers
    for policy in ("cuda", "auto"):
        with pytest.raises(ValueError, match="host_buffer_pool=True with a device budget"):
            _config(policy=policy, device_budget_bytes=2**30, host_buffer_pool=True)
    with pytest.raises(TypeError, match="host_buffer_pool must be a bool"):
        _config(host_buffer_pool="yes")


@needs_pool
def test_gemini_config_takes_host_buffer_pool_at_every_stage() -> None:
    for stage in (1, 2, 3):
        model = zero_model_wrapper(torch.nn.Linear(4, 4), stage, {"device": "cpu"})
        assert model.chunk_manager.buffer_pool is None
        assert model.pooled_bytes() == 0
        model = zero_model_wrapper(
            torch.nn.Linear(4, 4), stage, {"device": "cpu", "host_buffer_pool": True}
        )
        assert model.chunk_manager.buffer_pool is not None


def test_the_engines_buffers_ask_for_huge_pages_where_granted() -> None:
    """See [Note: huge pages for the engine's buffers] in memory/pages.py."""
    granted = kernel_grants_huge_pages() and sys.platform.startswith("linux")
    assert advise_huge_pages(torch.empty(4 << 20).untyped_storage()) is granted
    assert advise_huge_pages(torch.empty(16).untyped_storage()) is False  # under 4 MiB


@needs_pool
def test_buffers_of_one_size_class_serve_each_other() -> None:
    """Chunks of one model differ by a few elements: a spare serves any buffer of its class."""
    assert size_class(4096) == 4096  # small sizes are their own class
    for nbytes in (50_384_896, 50_647_040, 2**26 - 4, 2**20 + 4):
        assert nbytes <= size_class(nbytes) <= nbytes * 1.016
    assert size_class(50_384_896) == size_class(50_647_040)
    pool = BufferPool(1 << 30)
    small = pool.empty(12_596_224, torch.float32)  # allocated at its class's size
    assert small.untyped_storage().nbytes() == size_class(50_384_896)
    pool.give_back(small)
    large = pool.empty(12_661_760, torch.float32)
    assert pool.reused == 1 and large.shape == (12_661_760,)
    # A buffer freed from outside the pool holds its own size only: too small for a larger
    # buffer of its class, which gets a new one.
    pool.free(torch.empty(12_596_224))
    pool.free(large)
    payload = torch.empty(12_661_760)
    payload.untyped_storage().resize_(0)  # a released payload
    pool.fill(payload)
    assert pool.reused == 2 and payload.untyped_storage().nbytes() >= 50_647_040
    assert pool.spare_bytes == 50_384_896
