"""GatherScheduler on one process (stage 3 through `zero_model_wrapper`): chunks gathered
before the gather units that use them, released after their last use once the forward order
is recorded, the next chunk prefetched, and `PassTrace`'s record and replay."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardwise
from shardwise import CommOp, comm
from shardwise.chunk import Chunk, ChunkState
from shardwise.runtime.pass_trace import PassTrace


class _Net(nn.Module):
    """Chunks (20 elements each): a=0, b=1, c=2, d=3, called in the order of `route`: `a`
    twice, and not in chunk order."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))
        self.route = "cabad"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.route:
            x = getattr(self, name)(x).tanh()
        return x


def _states(chunks: list[Chunk]) -> str:
    """One letter per chunk: g(athered), p(refetch running) or s(harded)."""
    return "".join(
        "g" if c.payload.state is ChunkState.GATHERED else "p" if c.payload.gather_pending else "s"
        for c in chunks
    )


def _wrapped(prefetch: bool) -> tuple[_Net, nn.Module, shardwise.ZeroModel, list[str]]:
    torch.manual_seed(0)
    net = _Net()
    reference = copy.deepcopy(net)
    log: list[str] = []
    # Registered before wrapping, so they run before the scheduler's own hooks on each unit:
    # the pre-hook sees the chunks before the unit's gather, the post-hook before its release
    # (`chunks` is bound below, before any forward runs).
    for name in "abcd":
        module = getattr(net, name)
        module.register_forward_pre_hook(lambda m, a, n=name: log.append(f"{n}<{_states(chunks)}"))
        module.register_forward_hook(lambda m, a, o, n=name: log.append(f"{n}>{_states(chunks)}"))
    config = {"device": torch.device("cpu"), "chunk_size_numel": 20, "prefetch": prefetch}
    wrapped = shardwise.zero_model_wrapper(net, 3, config)
    chunks = wrapped.chunk_manager.chunks
    return net, reference, wrapped, log


def _step(wrapped: shardwise.ZeroModel, log: list[str]) -> tuple[list[str], str, int]:
    """One forward and backward: the hooks' log, the states after forward, its gathers."""
    log.clear()
    wrapped.comm_stats.reset()
    out = wrapped(torch.randn(2, 4))
    forward_log, after = list(log), _states(wrapped.chunk_manager.chunks)
    gathers = wrapped.comm_stats.calls(CommOp.ALL_GATHER)
    out.sum().backward()
    return forward_log, after, gathers


def test_chunks_are_gathered_for_their_units_and_released_after_last_use() -> None:
    _, _, wrapped, log = _wrapped(prefetch=False)
    first, after, gathers = _step(wrapped, log)
    # Each unit's chunk is gathered while it runs ("x>" sees it before its release). The
    # first pass has no record: `a` is released once all its tensors were used, and gathered
    # again for its second call.
    assert first == [
        "c<ssss", "c>ssgs", "a<ssss", "a>gsss", "b<ssss", "b>sgss", "a<ssss", "a>gsss",
        "d<ssss", "d>sssg",
    ]  # fmt: skip
    assert (after, gathers) == ("ssss", 5)
    for _ in range(2):
        replay, after, gathers = _step(wrapped, log)
        # Recorded: `c` is released after its only call, `a` only after its second one.
        assert replay == [
            "c<ssss", "c>ssgs", "a<ssss", "a>gsss", "b<gsss", "b>ggss", "a<gsss", "a>gsss",
            "d<ssss", "d>sssg",
        ]  # fmt: skip
        assert (after, gathers) == ("ssss", 4)


def test_forward_order_is_the_recorded_order_of_first_use() -> None:
    _, _, wrapped, log = _wrapped(prefetch=False)
    assert wrapped.scheduler is not None
    assert wrapped.scheduler.forward_order() == []  # nothing recorded yet
    first, _, _ = _step(wrapped, log)
    gathered = [entry[2:].index("g") for entry in first if ">" in entry]  # in use, by call
    assert wrapped.scheduler.forward_order() == list(dict.fromkeys(gathered)) == [2, 0, 1, 3]


class _PendingGather:
    """An all-gather still running: its output is written only when it is waited for."""

    def __init__(self, finish: Callable[[], object]) -> None:
        self._finish = finish

    def wait(self) -> bool:
        self._finish()
        return True


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_starts_the_next_chunks_gather_during_forward(
    monkeypatch: pytest.MonkeyPatch, prefetch: bool
) -> None:
    real = comm.all_gather

    def all_gather(
        output: torch.Tensor,
        shard: torch.Tensor,
        stats: shardwise.CommStats,
        group: object = None,
        async_op: bool = False,
        kind: CommOp = CommOp.ALL_GATHER,
    ) -> _PendingGather | None:
        # An asynchronous gather stays pending (its output unwritten) until waited for.
        if not async_op:
            return real(output, shard, stats, group, kind=kind)
        return _PendingGather(lambda: real(output, shard, stats, group, kind=kind))

    # chunk.py calls it as `comm.all_gather`, the package's name for it.
    monkeypatch.setattr(comm, "all_gather", all_gather)
    _, reference, wrapped, log = _wrapped(prefetch)
    first, _, _ = _step(wrapped, log)
    assert "p" not in "".join(first)  # nothing recorded, nothing to prefetch
    x = torch.randn(2, 4)
    log.clear()
    assert torch.allclose(wrapped(x), reference(x))  # every prefetch was waited for
    if not prefetch:
        assert "p" not in "".join(log)
        return
    # While `c` runs, chunk 0 (`a`, next) is being gathered; while `a` runs, chunk 1; `d`'s
    # chunk during the second `a`. A unit finds its chunk gathered or waits for the prefetch.
    assert log == [
        "c<ssss", "c>psgs", "a<psss", "a>gpss", "b<gpss", "b>ggss", "a<gsss", "a>gssp",
        "d<sssp", "d>sssg",
    ]  # fmt: skip
    # Backward starts with `d`, whose chunk stays gathered from the end of forward.
    assert _states(wrapped.chunk_manager.chunks) == "sssg"


def test_a_pass_off_the_record_releases_at_the_end_of_forward() -> None:
    net, _, wrapped, log = _wrapped(prefetch=False)
    _step(wrapped, log)  # records c, a, b, a, d
    net.route = "cbbad"
    replay, after, _ = _step(wrapped, log)
    # Off track from the first `b` (`a` expected): no release after last use from there on,
    # though the second `b` and then `a` end where the record says those chunks are done.
    assert replay[-2:] == ["d<ggss", "d>ggsg"]
    assert after == "ssss"
    net.route = "cabad"  # back on the record: released as they go again
    replay, after, _ = _step(wrapped, log)
    assert replay[-2:] == ["d<ssss", "d>sssg"]


def test_trace_records_then_replays_and_goes_off_track() -> None:
    trace = PassTrace()
    trace.begin()
    assert not trace.on_track  # nothing recorded to follow yet
    for step in [(0,), (0,), (1,), (1, 2)]:
        trace.visit(step)
        assert trace.upcoming() == ()
    trace.finish()
    assert trace.recorded and trace.steps == [(0,), (0,), (1,), (1, 2)]
    trace.begin()
    assert trace.on_track
    trace.visit((0,))
    assert trace.upcoming() == (1,)  # looks past the run of calls over chunk 0
    trace.visit((0,))
    assert trace.upcoming() == (1,)
    trace.visit((1,))
    assert trace.upcoming() == (2,)  # beyond the chunks of the call just visited
    trace.visit((1, 2))
    assert trace.upcoming() == ()
    trace.visit((3,))  # longer than the record
    assert not trace.on_track and trace.upcoming() == ()
    trace.finish()
    assert trace.steps == [(0,), (0,), (1,), (1, 2)]  # the record stays
    trace.begin()
    trace.visit((1,))  # departs at once
    assert not trace.on_track and trace.upcoming() == ()
    trace.visit((0,))  # matching a later step does not put it back on track
    assert not trace.on_track
