"""The part of a chunk's optimizer side the optimizer makes: the views of the fp32 master it
steps, and the per-element state (moments, momentum) it keeps for them.

[Note: the chunk owns its optimizer state]
The optimizer (any elementwise torch optimizer) keeps its state in `optimizer.state[view]`,
keyed by the shard views of [Note: the optimizer sees shard views] in engine/shard_views.py.
Those tensors are part of the chunk's optimizer side as much as its master is: they live in its
optim pool and move with it. So the chunk keeps a reference to each (the views, bound once when
the optimizer is wrapped; the state tensors, adopted after every step of the chunk, which may
have made or replaced them) and moves them itself, in place: assigning `tensor.data` keeps
each tensor's identity, so the optimizer's state dict keys and values stay the same objects
and nothing above the chunk has to re-point anything when the memory manager moves a chunk
between pools. Adopting a state tensor is a resident change (see [Note: resident changes] in
resident.py), so the memory manager's running totals count the state the first step makes.

The disk tier (see [Note: the disk tier] in memory/disk_pool.py) uses the same references: it writes
the master and the state tensors to a file and frees their storage (resized to zero, as a
released payload is), then reads them back into the same tensors before the chunk steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardwise.chunk.resident import resident_changed


class OptimizerState:
    """The views the optimizer steps over one chunk's master, and the state it keeps for them.

    Args:
        owner: the chunk (its resident changes are reported as the chunk's).
    """

    def __init__(self, owner: Any) -> None:
        self._owner = owner
        # (view the optimizer steps, begin, end within the master)
        self.views: list[tuple[torch.Tensor, int, int]] = []
        # The optimizer's per-element state of those views, in their order, keys sorted.
        self.tensors: list[torch.Tensor] = []

    def bind(self, view: torch.Tensor, begin: int, end: int) -> None:
        """`view` is `master[begin:end]` and the optimizer steps it."""
        self.views.append((view, begin, end))

    def unbind(self) -> None:
        """Forget the views and state of an optimizer before (a new one is wrapped)."""
        self.views = []
        if self.tensors:
            self.tensors = []
            resident_changed(self._owner, transient=False)

    def adopt(self, states: Iterable[dict[str, Any]]) -> int:
        """Take the optimizer's state of the bound views (`states`, one dict per view, in
        bind order) as this chunk's: its per-element tensors (those shaped as their view; a
        scalar such as Adam's `step` is not model state) move with the chunk from now on. A
        tensor not beside its view (a state loaded elsewhere) is moved there first. Returns
        the bytes so moved."""
        adopted: list[torch.Tensor] = []
        moved = 0
        for (view, _, _), state in zip(self.views, states, strict=True):
            for key in sorted(state):
                value = state[key]
                if not isinstance(value, torch.Tensor) or value.shape != view.shape:
                    continue
                if value.device != view.device:
                    moved += value.numel() * value.element_size()
                    value.data = value.data.to(view.device)
                adopted.append(value)
        if len(adopted) != len(self.tensors) or any(
            a is not b for a, b in zip(adopted, self.tensors, strict=True)
        ):
            self.tensors = adopted
            resident_changed(self._owner, transient=False)
        return moved

    def restore(self, tensors: list[torch.Tensor]) -> None:
        """Adopt `tensors` again as they were (a step that made others was rolled back)."""
        self.tensors = list(tensors)
        resident_changed(self._owner, transient=False)

    def follow(self, master: torch.Tensor) -> int:
        """Re-point the views at `master` (which replaced the old one: a move between pools)
        and move the state tensors to its device, in place. Returns the bytes of state
        moved."""
        for view, begin, end in self.views:
            view.data = master[begin:end]
        moved = 0
        for value in self.tensors:
            if value.device != master.device:
                moved += value.numel() * value.element_size()
                value.data = value.data.to(master.device)
        return moved

    def nbytes(self) -> int:
        """Bytes of state held now (zero for state written out to the disk tier)."""
        return sum(
            value.numel() * value.element_size()
            for value in self.tensors
            if value.untyped_storage().size()
        )

    def numel(self) -> int:
        """Elements of state, wherever it is held."""
        return sum(value.numel() for value in self.tensors)
