"""GradReducer on one process: gradients routed into chunks by post-accumulate hooks, and
chunks reduced in the reducer's fixed order, with a fake reduce-scatter whose waits we see."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from shardwise import comm
from shardwise.chunk import Chunk, ChunkManager
from shardwise.runtime.grad_reducer import GradReducer

CPU = torch.device("cpu")
Log = list[tuple[str, object]]


class _FakeWork:
    """A reduce-scatter still running: its output slice holds NaN until it is waited for, so
    reading the slice early would show."""

    def __init__(self, log: Log, chunk_id: int, full: torch.Tensor, out: torch.Tensor) -> None:
        self._log, self._chunk_id, self._full, self._out = log, chunk_id, full, out

    def wait(self) -> bool:
        self._log.append(("wait", self._chunk_id))
        self._out.copy_(self._full)  # one rank: the reduced slice is the whole buffer
        return True


def _setup(
    monkeypatch: pytest.MonkeyPatch, model: nn.Module | None = None, **options: object
) -> tuple[nn.Module, nn.Module, ChunkManager, GradReducer, Log, dict[int, torch.Tensor]]:
    torch.manual_seed(0)
    if model is None:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    # 20 elements: one Linear(4, 4) per chunk, chunk i holding layer i.
    manager = ChunkManager(chunk_size_numel=20, device=CPU, keep_gathered=True)
    manager.register(model.named_parameters())
    log: Log = []
    sent: dict[int, torch.Tensor] = {}
    # Registered before the reducer's hooks, so each runs first: a "grad" entry precedes
    # whatever the reducer does with that gradient.
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: log.append(("grad", name)))

    def reduce_to_shard(
        full: torch.Tensor,
        method: object,
        stats: object,
        group: object,
        async_op: bool,
        allocate: object = None,
    ) -> tuple[_FakeWork | None, torch.Tensor]:
        chunk = next(c for c in manager.chunks if c.grads.full is full)
        log.append(("start", chunk.chunk_id))
        sent[chunk.chunk_id] = full.clone()
        out = torch.full_like(full, float("nan"))
        if not async_op:
            return None, out.copy_(full)
        return _FakeWork(log, chunk.chunk_id, full, out), out

    # reduction.py calls it as `comm.reduce_to_shard`, the package's name for it.
    monkeypatch.setattr(comm, "reduce_to_shard", reduce_to_shard)
    callbacks = {
        "on_complete": lambda c: log.append(("complete", c.chunk_id)),
        "on_reduced": lambda c: log.append(("reduced", c.chunk_id)),
    }
    # The caller keeps the reducer (`_reducer`): its hooks hold it weakly, as the model does.
    reducer = GradReducer(manager, **{**callbacks, **options})  # type: ignore[arg-type]
    return model, reference, manager, reducer, log, sent


def _backward(model: nn.Module, reference: nn.Module, seed: int = 1) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    model(x).sum().backward()
    reference(x).sum().backward()


def _assert_reduced(manager: ChunkManager, reference: nn.Module, buffer: str = "shard") -> None:
    """Each chunk's `buffer` holds the reference model's gradients (zeros where it got none)."""
    grads = {name: p.grad for name, p in reference.named_parameters()}
    for chunk in manager.chunks:
        expected = [
            grads[t.name] if grads[t.name] is not None else torch.zeros(t.numel)
            for t in chunk.tensors
        ]
        flat = torch.cat([grad.reshape(-1) for grad in expected])  # type: ignore[union-attr]
        assert torch.allclose(getattr(chunk.grads, buffer), flat), chunk


def _ops(log: Log, *kinds: str) -> str:
    return ", ".join(f"{kind} {what}" for kind, what in log if kind in kinds)


def test_gradients_are_copied_into_chunks_as_autograd_accumulates_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, reference, manager, _reducer, log, _ = _setup(monkeypatch, reduce_in_backward=False)
    for seed in (1, 2):  # the second pass adds onto the kept buffer
        _backward(model, reference, seed)
    _assert_reduced(manager, reference, "full")
    # The chunk holds the gradient: the per-parameter copy was dropped.
    assert all(p.grad is None for p in model.parameters())
    assert _ops(log, "start", "reduced") == ""  # stage 1: nothing reduced in backward


def test_chunk_is_reduced_as_soon_as_its_trainable_tensors_have_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, reference, manager, _reducer, log, _ = _setup(monkeypatch, reduce_in_backward=True)
    _backward(model, reference)
    for chunk in manager.chunks:
        last_grad = max(log.index(("grad", info.name)) for info in chunk.tensors)
        # Right after its last gradient (and its "complete"), before any other chunk's.
        assert log.index(("start", chunk.chunk_id)) == last_grad + 2, log
        assert chunk.grads.full is None  # freed once reduced
    assert _ops(log, "start") == "start 2, start 1, start 0"
    _assert_reduced(manager, reference)


def test_a_ready_chunk_waits_for_the_chunks_before_it_in_the_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, reference, _, reducer, log, _ = _setup(monkeypatch, reduce_in_backward=True)
    # Backward completes layer 2 first; an order starting at chunk 0 holds it back.
    reducer.suggest_order([0, 1, 2])
    _backward(model, reference)
    assert _ops(log, "complete", "reduced") == (
        "complete 2, complete 1, complete 0, reduced 0, reduced 1, reduced 2"
    )
    # The first backward settled the order in which chunks actually completed there.
    log.clear()
    _backward(model, reference, seed=2)
    assert _ops(log, "complete", "reduced") == (
        "complete 2, reduced 2, complete 1, reduced 1, complete 0, reduced 0"
    )


@pytest.mark.parametrize(
    ("max_in_flight", "expected"),
    [
        (1, "start 2, wait 2, start 1, wait 1, start 0, wait 0"),
        (2, "start 2, start 1, wait 2, start 0, wait 1, wait 0"),
    ],
)
def test_overlap_bounds_the_reductions_in_flight(
    monkeypatch: pytest.MonkeyPatch, max_in_flight: int, expected: str
) -> None:
    model, reference, manager, _reducer, log, _ = _setup(
        monkeypatch, reduce_in_backward=True, overlap=True, max_in_flight=max_in_flight
    )
    _backward(model, reference)
    assert _ops(log, "start", "wait") == expected
    # Overlapped: chunk 2's reduction is still pending while layer 1's gradients arrive.
    assert log.index(("start", 2)) < log.index(("grad", "1.weight")) < log.index(("wait", 2))
    # A chunk counts as reduced only once its collective was waited for (the fake's slice
    # holds NaN until then).
    for chunk_id in range(3):
        assert log.index(("wait", chunk_id)) < log.index(("reduced", chunk_id))
    _assert_reduced(manager, reference)


def test_unsynced_passes_stay_unreduced_until_reduce_all(monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference, manager, reducer, log, _ = _setup(monkeypatch, reduce_in_backward=True)
    with reducer.unsynced():
        _backward(model, reference, seed=1)
        _backward(model, reference, seed=2)
    assert _ops(log, "start", "reduced") == ""
    assert all(torch.count_nonzero(chunk.grads.shard) == 0 for chunk in manager.chunks)
    reducer.reduce_all()
    assert _ops(log, "reduced") == "reduced 2, reduced 1, reduced 0"
    _assert_reduced(manager, reference)  # the sum of both passes, reduced once
    log.clear()
    reducer.reduce_all()  # nothing left
    assert _ops(log, "start") == ""


def test_on_complete_precedes_the_reduction_and_on_reduced_follows_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[str, int, bool, bool]] = []

    def note(kind: str) -> Callable[[Chunk], None]:
        def callback(chunk: Chunk) -> None:
            has_full = chunk.grads.full is not None
            seen.append((kind, chunk.chunk_id, has_full, bool(chunk.grads.shard.any())))

        return callback

    model, reference, _, _reducer, *_ = _setup(
        monkeypatch,
        reduce_in_backward=True,
        on_complete=note("complete"),
        on_reduced=note("reduced"),
    )
    _backward(model, reference)
    # Complete: gradients in the full buffer, shard not yet written. Reduced: the reverse.
    assert seen == [
        (kind, chunk_id, kind == "complete", kind == "reduced")
        for chunk_id in (2, 1, 0)
        for kind in ("complete", "reduced")
    ]


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.unused, self.last = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(x))


def test_chunk_without_gradients_is_reduced_with_zeros_when_backward_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, reference, manager, _reducer, log, sent = _setup(
        monkeypatch, model=_Branchy(), reduce_in_backward=True
    )
    _backward(model, reference)
    # Chunk 1 (`unused`) never completes, so chunk 0 waits behind it until backward ends;
    # then both are reduced, chunk 1 with zeros: every rank issues the same collectives.
    assert _ops(log, "complete", "start") == "complete 2, start 2, complete 0, start 1, start 0"
    assert torch.equal(sent[1], torch.zeros(20))
    _assert_reduced(manager, reference)  # chunk 1: zeros
