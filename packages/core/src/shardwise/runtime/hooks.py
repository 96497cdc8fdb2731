"""The handles of the hooks an engine puts on a user's module and tensors, removable at once.

[Note: one owner of an engine's hooks]
A wrapped model hooks the user's objects in several places: the root module's forward hooks
(the model's own), the gather schedule's hooks on its units (stage 3), the deferred gathers'
pre-hooks (stages 1 and 2) and a gradient hook on every trainable tensor. Each part adds its
handles to a `HookSet` it is given, a part of the one set the model owns, so that one call
removes them all (`ZeroModel.release_module`) and a rebuilt part removes only its own (the
reducer and schedule rebuilt for a new bucket size). The parts that run passes are owned by a
`Runtime` (runtime/runtime.py), which removes their hooks when it is closed or collected.
"""

from __future__ import annotations

from torch.utils.hooks import RemovableHandle


class HookSet:
    """Removable hook handles, and the sets of parts within (removed with this one)."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._parts: list[HookSet] = []

    def add(self, handle: RemovableHandle) -> RemovableHandle:
        self._handles.append(handle)
        return handle

    def part(self) -> HookSet:
        """A set of its own within this one: removed by its own `remove()` or with this set."""
        # Parts emptied since (a rebuilt reducer's) are forgotten here.
        self._parts = [part for part in self._parts if len(part)]
        part = HookSet()
        self._parts.append(part)
        return part

    def remove(self) -> None:
        """Remove every hook of this set and its parts (again: nothing)."""
        for part in self._parts:
            part.remove()
        self._parts.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __len__(self) -> int:
        return len(self._handles) + sum(len(part) for part in self._parts)
