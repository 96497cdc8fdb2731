"""DeviceTally on one process: the device bytes it reports for a chunk manager's chunks as they
are gathered, given gradients, reduced, released and moved between pools; the optimizer state
it counts (only where a chunk's optim pool is the device, as the chunk adopts it); that
it recounts only the chunks that changed, and of those only the transient buffers when only
those changed (see [Note: device tally]); that it picks up chunks packed after it was built;
and the error for a chunk it does not count.

On a host without GPUs both pools are host memory, but they are still accounted apart (see
`Pool`), so the device counts are testable here."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn

from shardwise import ChunkManager
from shardwise.chunk import Chunk, Pool
from shardwise.chunk.accounting import device_resident_bytes, transient_bytes
from shardwise.chunk.reduction import reduce_now
from shardwise.gemini import device_tally
from shardwise.gemini.device_tally import DeviceTally

CPU = torch.device("cpu")
CHUNK_BYTES = 20 * 4  # one Linear(4, 4) per chunk, fp32; one rank: the shard is the chunk
STATE = 2 * CHUNK_BYTES  # the optimizer state the tests say a trainable chunk has


def _manager(num_chunks: int = 4, *, keep_gathered: bool = False) -> ChunkManager:
    """`num_chunks` chunks of one Linear(4, 4) each; the last one frozen."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(num_chunks)))
    model[num_chunks - 1].requires_grad_(False)
    manager = ChunkManager(chunk_size_numel=20, device=CPU, keep_gathered=keep_gathered)
    manager.register(model.named_parameters())
    _allocate_grad_shards(manager)
    return manager


def _allocate_grad_shards(manager: ChunkManager) -> None:
    """As after a first step: each trainable chunk's gradient shard is allocated (see [Note:
    the gradient shard is allocated when first written] in chunk/grads.py)."""
    for chunk in manager.trainable_chunks():
        chunk.grads.for_step()


def _give_state(manager: ChunkManager, copies: int = 2) -> None:
    """Give each trainable chunk the state an optimizer stepping its whole master would keep:
    `copies` fp32 tensors of the master's shape (Adam's two moments: STATE bytes)."""
    for chunk in manager.trainable_chunks():
        _adopt(chunk, copies)


def _adopt(chunk: Chunk, copies: int) -> None:
    states = chunk.optimizer_state
    if not states.views:
        states.bind(chunk.master[:], 0, chunk.master.numel())
    view = states.views[0][0]
    states.adopt([{f"moment{n}": torch.zeros_like(view) for n in range(copies)}])


def _fresh_count(manager: ChunkManager) -> int:
    """The device bytes of every chunk counted from scratch, optimizer state included."""
    return sum(
        device_resident_bytes(c)
        + (c.optimizer_state.nbytes() if c.placement.optim is Pool.DEVICE else 0)
        for c in manager.chunks
    )


def _add_grads(chunk: Chunk) -> None:
    for index, info in enumerate(chunk.tensors):
        chunk.grads.add(index, torch.ones(info.shape))


def test_counts_buffers_and_state_in_the_device_pool_and_nothing_in_host_memory() -> None:
    manager = _manager()
    _give_state(manager)
    tally = DeviceTally(manager)
    chunks = manager.chunks
    chunks[0].place(payload=Pool.DEVICE, optim=Pool.DEVICE)  # the master is the shard
    chunks[1].place(payload=Pool.HOST, optim=Pool.DEVICE)  # a master of its own
    chunks[2].place(payload=Pool.DEVICE, optim=Pool.HOST)
    chunks[3].place(payload=Pool.HOST, optim=Pool.HOST)  # frozen
    # Shard, master, gradient shard, optimizer state; each in CHUNK_BYTES.
    expected = [1 + 0 + 1 + 2, 0 + 1 + 1 + 2, 1, 0]
    assert [tally.chunk_device_bytes(c) for c in chunks] == [n * CHUNK_BYTES for n in expected]
    assert tally.device_bytes() == sum(expected) * CHUNK_BYTES
    assert tally.transient_bytes() == 0  # nothing gathered, no gradient buffer


def test_gather_gradients_reduction_and_release_move_both_totals_by_their_bytes() -> None:
    manager = _manager()
    _give_state(manager)
    tally = DeviceTally(manager)
    for chunk in manager.chunks:  # placement "cpu": nothing on the device at rest
        chunk.place(payload=Pool.HOST, optim=Pool.HOST)
    chunk = manager.chunks[1]
    steps = [
        ("at rest", lambda: None, 0),
        ("gathered", chunk.payload.gather, 1),  # the payload comes to the device
        ("gradients", lambda: _add_grads(chunk), 2),  # so does the gradient buffer
        ("released", chunk.payload.release, 1),
        ("reduced", lambda: reduce_now([chunk], keep_full=False), 0),  # into the host shard
    ]
    for where, step, held in steps:
        step()
        assert tally.device_bytes() == held * CHUNK_BYTES, where
        assert tally.transient_bytes() == held * CHUNK_BYTES, where
        assert tally.chunk_device_bytes(chunk) == held * CHUNK_BYTES, where
        assert tally.chunk_device_bytes(manager.chunks[0]) == 0, where


def test_moving_a_shard_or_an_optimizer_side_between_pools_is_counted() -> None:
    manager = _manager()
    _give_state(manager)
    tally = DeviceTally(manager)
    chunk = manager.chunks[0]
    at_rest = tally.device_bytes()
    # Shard (also the master), gradient shard and state of chunk 0 on the device.
    assert tally.chunk_device_bytes(chunk) == 4 * CHUNK_BYTES
    chunk.move_payload(Pool.HOST)
    # The master stays behind on the device as its own tensor.
    assert tally.chunk_device_bytes(chunk) == 4 * CHUNK_BYTES
    chunk.move_optim(Pool.HOST)  # master, gradient shard, and with them the state
    assert tally.chunk_device_bytes(chunk) == 0
    assert tally.device_bytes() == at_rest - 4 * CHUNK_BYTES
    chunk.move_optim(Pool.DEVICE)
    assert tally.chunk_device_bytes(chunk) == 4 * CHUNK_BYTES
    chunk.move_payload(Pool.DEVICE)  # the fp32 master is the shard again: one copy fewer
    chunk.move_optim(Pool.HOST)
    chunk.move_optim(Pool.DEVICE)
    assert tally.chunk_device_bytes(chunk) == 4 * CHUNK_BYTES
    assert tally.device_bytes() == at_rest


def test_optimizer_state_is_counted_when_a_chunk_adopts_it() -> None:
    manager = _manager()
    tally = DeviceTally(manager)
    before = tally.device_bytes()  # no optimizer has stepped: no state
    _give_state(manager)
    trainable = sum(c.requires_grad for c in manager.chunks)
    assert tally.device_bytes() == before + trainable * STATE
    chunk = manager.chunks[0]
    _adopt(chunk, copies=5)  # the optimizer replaced chunk 0's state with more
    # Shard (also the master), gradient shard, five state tensors.
    assert tally.chunk_device_bytes(chunk) == (1 + 1 + 5) * CHUNK_BYTES
    assert tally.device_bytes() == _fresh_count(manager)
    chunk.move_optim(Pool.HOST)  # master, gradient shard and state go; the shard stays
    assert tally.chunk_device_bytes(chunk) == CHUNK_BYTES
    assert tally.device_bytes() == _fresh_count(manager)


def test_only_changed_chunks_are_recounted_and_only_their_transient_part_when_only_it_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    resting: Counter[int] = Counter()
    transient: Counter[int] = Counter()
    count_resting, count_transient = device_tally.resting_device_bytes, device_tally.transient_bytes

    def counting_resting(chunk: Chunk) -> int:
        resting[chunk.chunk_id] += 1
        return count_resting(chunk)

    def counting_transient(chunk: Chunk) -> int:
        transient[chunk.chunk_id] += 1
        return count_transient(chunk)

    monkeypatch.setattr(device_tally, "resting_device_bytes", counting_resting)
    monkeypatch.setattr(device_tally, "transient_bytes", counting_transient)
    manager = _manager()
    _give_state(manager)
    tally = DeviceTally(manager)
    tally.device_bytes()
    everyone = Counter({c.chunk_id: 1 for c in manager.chunks})
    assert resting == transient == everyone
    tally.device_bytes()  # nothing changed: nothing recounted
    assert resting == transient == everyone
    chunk = manager.chunks[2]
    chunk.payload.gather()
    _add_grads(chunk)
    tally.device_bytes()
    # A gather and a gradient buffer change only the transient part.
    assert transient == everyone + Counter({2: 1})
    assert resting == everyone
    chunk.move_payload(Pool.HOST)
    tally.transient_bytes()
    assert transient == everyone + Counter({2: 2})
    assert resting == everyone + Counter({2: 1})
    _adopt(manager.chunks[1], copies=3)  # new state: a change of what it keeps
    tally.chunk_device_bytes(manager.chunks[1])
    assert resting == everyone + Counter({1: 1, 2: 1})


def test_chunks_packed_after_the_tally_was_built_are_counted_and_watched() -> None:
    manager = ChunkManager(chunk_size_numel=20, device=CPU, keep_gathered=False)
    tally = DeviceTally(manager)  # as GeminiManager builds it: before packing
    assert tally.device_bytes() == tally.transient_bytes() == 0
    manager.register(nn.Linear(4, 4).named_parameters())
    _allocate_grad_shards(manager)
    _give_state(manager)
    (first,) = manager.chunks
    assert tally.device_bytes() == 4 * CHUNK_BYTES
    manager.register(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).named_parameters())
    _allocate_grad_shards(manager)
    _give_state(manager)
    assert tally.device_bytes() == 3 * 4 * CHUNK_BYTES
    last = manager.chunks[-1]
    assert tally.chunk_device_bytes(last) == 4 * CHUNK_BYTES
    for chunk in (first, last):  # a change of a chunk of either packing is heard
        chunk.payload.gather()
    assert tally.transient_bytes() == 2 * CHUNK_BYTES
    assert tally.device_bytes() == (3 * 4 + 2) * CHUNK_BYTES


@pytest.mark.parametrize("keep_gathered", [False, True], ids=["sharded", "kept-gathered"])
def test_totals_agree_with_a_fresh_count_through_a_training_step(keep_gathered: bool) -> None:
    manager = _manager(keep_gathered=keep_gathered)
    _give_state(manager)
    tally = DeviceTally(manager)
    chunks = manager.chunks
    trainable = [c for c in chunks if c.requires_grad]
    events: list[tuple[str, Callable[[], None]]] = []
    if keep_gathered:
        # Stage 1: the gradient shard is a slice of the gradient buffer it keeps.
        events.append(("stage 1 layout", lambda: [c.share_grad_shard_with_full() for c in chunks]))
    else:
        events.append(("host shard", lambda: chunks[0].place(payload=Pool.HOST, optim=Pool.HOST)))
        events += [(f"gather {c.chunk_id}", c.payload.gather) for c in chunks]
    events += [(f"grads {c.chunk_id}", lambda c=c: _add_grads(c)) for c in reversed(trainable)]
    if not keep_gathered:
        events += [(f"release {c.chunk_id}", c.payload.release) for c in chunks]
    events.append(("reduce", lambda: reduce_now(trainable, keep_full=keep_gathered)))
    if not keep_gathered:  # (stage 1's gradient shard lives in its buffer on the device)
        events.append(("optimizer side to host", lambda: trainable[-1].move_optim(Pool.HOST)))
    for where, event in events:
        event()
        device = tally.device_bytes()
        assert device == _fresh_count(manager), where
        assert tally.transient_bytes() == sum(transient_bytes(c) for c in chunks), where
        assert sum(tally.chunk_device_bytes(c) for c in chunks) == device, where
        assert 0 <= tally.transient_bytes() <= device, where


def test_asking_about_a_chunk_the_manager_does_not_hold_raises() -> None:
    tally = DeviceTally(_manager(2))
    other = _manager(3).chunks[2]  # an id the tally's manager has no chunk for
    with pytest.raises(ValueError, match="not one of this tally's chunk manager's"):
        tally.chunk_device_bytes(other)
    with pytest.raises(ValueError, match="not one of this tally's chunk manager's"):
        tally.chunk_device_bytes(_manager(2).chunks[0])  # same id, another manager's chunk
