"""Counters that tell whether every rank runs the same passes and steps, and the check.

[Note: ranks in step]
Data parallelism pairs the i-th collective of every rank with the i-th of the others. A rank
that skips a batch after catching an error, or evaluates alone under `if rank == 0`, shifts
that pairing: stages 1-2 then average gradients of different batches and hang when one rank
runs out of data first; at stage 3 a gather meets another rank's reduction and gloo aborts, or
every rank waits forever. Each rank therefore counts what it ran since the last optimizer step
(forward passes with and without gradients, backward passes) and checks that every rank agrees:
- at every step, inside the gradient-norm all-reduce the step makes anyway (no extra
  collective), comparing the step count and the forward passes run with gradients (a forward
  under no_grad issues no collective at stages 1-2, so a rank-0-only evaluation is harmless
  there);
- at stage 3 also at the start of every forward and backward pass, with one all-reduce of a
  few numbers before the pass's first gather, since there every pass is a chain of collectives.
On a mismatch every rank raises `RanksOutOfStep` naming what each rank was doing (one more
all-gather, on the error path only).

The stage-3 check also carries a fingerprint of the modules whose gather hooks ran since the
previous check (`VisitTrail`). Ranks that called different modules (a branch taken on some
ranks only, outside a conditional unit: see [Note: conditional units] in runtime/gather_units.py)
issue different gathers; where that did not already hang (the branch's chunks were gathered
anyway), every rank raises here, naming the modules and the block to gather as one, before a
later step's divergence hangs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup, ReduceOp

from shardwise import comm
from shardwise.comm import CommStats

# Counters travel in float64 sums of squares (see engine/grad_norm.py): keep them small.
_WRAP = 1 << 20
_HASH_MODULUS = 1_048_573  # a prime below 2**20


class RanksOutOfStep(RuntimeError):
    """Ranks ran different passes or steps; raised on every rank alike."""


@dataclass(slots=True)
class _Position:
    steps: int = 0
    forwards: int = 0
    grad_forwards: int = 0
    backwards: int = 0

    def describe(self, phase: str) -> str:
        return (
            f"{phase} ({self.steps} optimizer step(s) done; since the last one "
            f"{self.grad_forwards} forward(s) with gradients, "
            f"{self.forwards - self.grad_forwards} without, {self.backwards} backward(s))"
        )


class VisitTrail:
    """The hooked modules that ran since the last pass check, as indices into `names`."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._visits: list[int] = []
        self._hash = 0

    def register(self, name: str) -> int:
        self.names.append(name)
        return len(self.names) - 1

    def add(self, index: int) -> None:
        self._visits.append(index)
        self._hash = (self._hash * 31 + index + 1) % _HASH_MODULUS

    def fingerprint(self) -> tuple[float, float]:
        """How many visits and their order-sensitive hash, small enough for float64."""
        return float(len(self._visits) % _WRAP), float(self._hash)

    def take(self) -> list[int]:
        """The visits since the last call (indices into `names`), and start afresh."""
        visits = self._visits
        self._visits, self._hash = [], 0
        return visits


class RankSync:
    """This rank's pass and step counters, and the checks against the other ranks'.

    Args:
        stats: counts the checks' bytes.
        group: the data-parallel group.
        check_passes: check at the start of every pass too (stage 3).
        trail: the modules whose hooks ran since the last check (stage 3's gather schedule
            records them), compared across ranks when the counters differ; None when there
            is none to compare.
    """

    def __init__(
        self,
        stats: CommStats,
        group: ProcessGroup | None,
        *,
        check_passes: bool,
        trail: VisitTrail | None = None,
    ):
        self._stats = stats
        self._group = group
        self._check_passes = check_passes and comm.world_size(group) > 1
        self._position = _Position()
        self.trail = trail

    def forward_started(self, device: torch.device) -> None:
        position = self._position
        position.forwards += 1
        grad = torch.is_grad_enabled()
        if grad:
            position.grad_forwards += 1
        if self._check_passes:
            self._check_pass(device, phase=1 if grad else 0)

    def backward_started(self, device: torch.device) -> None:
        self._position.backwards += 1
        if self._check_passes:
            self._check_pass(device, phase=2)

    def step_signature(self) -> tuple[float, ...]:
        """What the step compares across ranks, carried in its gradient-norm all-reduce."""
        position = self._position
        return (float(position.steps % _WRAP), float(position.grad_forwards % _WRAP))

    def step_checked(self, agreed: bool) -> None:
        """After the step's all-reduce: raise on every rank when the signatures differed, else
        start counting the next step."""
        if not agreed:
            self._raise("at the optimizer step")
        self._position = _Position(steps=self._position.steps + 1)

    def _signature(self, phase: int) -> list[float]:
        p = self._position
        values = (p.steps, p.forwards, p.grad_forwards, p.backwards, phase)
        trail = self.trail.fingerprint() if self.trail is not None else (0.0, 0.0)
        return [float(v % _WRAP) for v in values] + list(trail)

    def _check_pass(self, device: torch.device, phase: int) -> None:
        signature = self._signature(phase)
        mine = torch.tensor(signature, dtype=torch.float64, device=device)
        both = torch.cat([mine, -mine])
        comm.all_reduce(both, self._stats, self._group, op=ReduceOp.MAX)
        n = mine.numel()
        visits = self.trail.take() if self.trail is not None else []
        if torch.equal(both[:n], -both[n:]):
            return
        counters = n - 2  # the trail's fingerprint comes last
        if not torch.equal(both[:counters], -both[n : n + counters]):
            self._raise(_PHASES[phase])
        assert self.trail is not None  # only the trail's fingerprint is left to differ
        names = self.trail.names
        self._raise_modules_differ([names[i] for i in visits], _PHASES[phase])

    def _raise_modules_differ(self, visited: list[str], phase: str) -> None:
        everyone = [set(v) for v in comm.all_gather_object(visited, self._stats, self._group)]
        some = set().union(*everyone) - set.intersection(*everyone)
        lines = (
            "\n".join(
                f"  {name}: ran on rank(s) {[r for r, v in enumerate(everyone) if name in v]}"
                for name in sorted(some)
            )
            or "  (the same modules, in another order)"
        )
        blocks = sorted({name.rpartition(".")[0] or "<the model>" for name in some})
        raise RanksOutOfStep(
            f"ranks called different modules before {phase}:\n{lines}\n"
            f"At stage 3 each module gathers its parameters with a collective, so every rank "
            f"must call the same modules; this time no gather was missed, a later step's would "
            f"hang. Gather the enclosing block as one unit: "
            f"gemini_config={{'gather_units': {blocks}}} (or the block's class). Blocks holding "
            f"a ModuleList/ModuleDict of experts are found by themselves"
        )

    def _raise(self, phase: str) -> None:
        doing = self._position.describe(phase)
        everyone = comm.all_gather_object(doing, self._stats, self._group)
        lines = "\n".join(f"  rank {rank}: {what}" for rank, what in enumerate(everyone))
        raise RanksOutOfStep(
            f"ranks are out of step:\n{lines}\n"
            f"Every rank must run the same forward and backward passes and optimizer steps "
            f"(their collectives pair up across ranks). A rank that skips a batch after an "
            f"error, or a forward on some ranks only (an evaluation under `if rank == 0`), "
            f"breaks that: skip a batch on every rank alike, and evaluate on every rank or on "
            f"rank 0 from model.state_dict() (see the README's 'Ranks in step')"
        )


_PHASES = {
    0: "starting a forward without gradients",
    1: "starting a forward with gradients",
    2: "starting a backward",
}
