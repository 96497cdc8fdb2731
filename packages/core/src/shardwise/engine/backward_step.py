"""Which chunks a `ZeroOptimizer` stepped during backward, and what makes that step wrong.

[Note: the optimizer steps during backward]
With `step_in_backward=True` a chunk steps when its reduced gradient is in, during the
backward that reduced it (see [Note: stepping during backward] in runtime/runtime.py), and
`step()` steps only what is left. The update is the one `step()` would make: the same
gradient shard, the same hyperparameters and, where every tensor of the chunk got a gradient
on this rank, the same "reached" flags (a tensor that got one here got one somewhere). So a
chunk steps early only where nothing global decides its update:
- its gradient reached every tensor of it on this rank (otherwise only the step's all-reduce
  says whether another rank's did: see [Note: tensors without gradients] in optimizer.py);
- it is sharded (a chunk kept gathered publishes by an all-gather, a collective every rank
  must issue in one order) and its optimizer side is in memory (the disk tier's chunks step
  together and agree: see [Note: the disk tier in the step] in step_loop.py);
- no module uses its parameters now.
The other chunks step in `step()`. What cannot be known during backward is refused or said:
clipping and fp16's overflow check need the whole gradient first (refused at construction);
a non-finite gradient is stepped as a plain torch loop steps it, not skipped (a warning says
so); a second reduction into a chunk that stepped (gradient accumulation without `no_sync()`)
and hyperparameters changed between backward and `step()` raise `ValueError`.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.chunk import Chunk

_NOT_COMPARED = ("params",)


class StepsInBackward:
    """The chunks stepped during the backward passes since the last `step()`, and the
    hyperparameters they stepped with."""

    def __init__(self) -> None:
        self.stepped: set[int] = set()
        self._hyperparameters: list[dict[str, Any]] | None = None

    @staticmethod
    def could_step(chunk: Chunk) -> bool:
        """Whether `chunk` is of a kind that can step during backward at all: sharded, its
        optimizer side in memory."""
        return not chunk.keep_gathered and not chunk.tier.fallible

    @staticmethod
    def may_step(chunk: Chunk) -> bool:
        """Whether `chunk`, just reduced, can step now (see [Note: the optimizer steps during
        backward])."""
        return (
            StepsInBackward.could_step(chunk)
            and not chunk.in_use
            and len(chunk.grads.received) == len(chunk.tensors)
        )

    def check_not_stepped(self, chunk: Chunk) -> None:
        """Refuse a second reduction into a chunk that stepped since the last `step()`."""
        if chunk.chunk_id in self.stepped:
            raise ValueError(
                f"chunk {chunk.chunk_id} stepped during an earlier backward since the last "
                f"step() (step_in_backward=True), and another backward reduced gradients into "
                f"it: gradient accumulation needs every micro-batch but the last under "
                f"no_sync(), or step_in_backward=False"
            )

    def record(self, chunk: Chunk, param_groups: list[dict[str, Any]]) -> None:
        """`chunk` stepped with `param_groups`' hyperparameters."""
        if self._hyperparameters is None:
            self._hyperparameters = _hyperparameters(param_groups)
        self.stepped.add(chunk.chunk_id)

    def take(self, param_groups: list[dict[str, Any]], *, gradients_left: bool = False) -> set[int]:
        """At `step()`: the chunks stepped during backward, forgotten here; raises when
        `param_groups` changed since they stepped, or when later passes under no_sync() left
        gradients (`gradients_left`) that would reach them too."""
        stepped, self.stepped = self.stepped, set()
        if stepped and gradients_left:
            raise ValueError(
                f"{len(stepped)} chunks stepped during a backward (step_in_backward=True) and "
                f"a later backward under no_sync() left gradients for them: accumulate under "
                f"no_sync() before the last micro-batch's backward, not after it"
            )
        before, self._hyperparameters = self._hyperparameters, None
        if before is not None and not _same(before, _hyperparameters(param_groups)):
            raise ValueError(
                f"the optimizer's hyperparameters changed between backward and step(), after "
                f"{len(stepped)} chunks had stepped during backward with the old ones "
                f"(step_in_backward=True): change them after step() (as LR schedulers do), "
                f"or use step_in_backward=False"
            )
        return stepped

    def forget(self) -> set[int]:
        """At `zero_grad()` without `step()`: the chunks stepped during backward, forgotten
        (they keep their step; nothing is compared, nothing else will step)."""
        stepped, self.stepped = self.stepped, set()
        self._hyperparameters = None
        return stepped


def _hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            key: value.clone() if isinstance(value, torch.Tensor) else value
            for key, value in group.items()
            if key not in _NOT_COMPARED
        }
        for group in param_groups
    ]


def _same(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> bool:
    if len(before) != len(now):
        return False
    for old, new in zip(before, now, strict=True):
        if old.keys() != new.keys():
            return False
        for key, value in old.items():
            other = new[key]
            if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
                if not (
                    isinstance(value, torch.Tensor)
                    and isinstance(other, torch.Tensor)
                    and torch.equal(value, other)
                ):
                    return False
            elif value != other:
                return False
    return True


__all__ = ["StepsInBackward"]
