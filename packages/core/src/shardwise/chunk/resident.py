"""Attributes of a chunk whose change alters what it holds where.

[Note: resident changes]
The memory manager checks the device's bytes after every gather and gradient copy; counting
every chunk's buffers each time cost most of a step under "auto" on a model of many chunks.
So the attributes that decide a chunk's resident bytes (its buffers, their pools, its gradient
layout) are `Resident` descriptors: assigning one calls `resident_changed`, as does resizing a
buffer's storage (`Payload._materialise`, `Payload._free`), which tells the chunk's
`resident_watch` (the manager's running totals, see [Note: device tally] in
gemini/device_tally.py), so that only chunks that changed are counted again. A change says
whether it was transient: one of the buffers a step allocates and frees (the gathered payload
and its compute copy, which are resized in place, and the gradient buffer and the secondary
copy, which are assigned). The buffers a chunk keeps between steps change only by assignment,
a few times a run, so their count is kept until one does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class ResidentWatch(Protocol):
    """What a chunk tells of its resident changes, implemented by whoever keeps running totals
    of chunks' bytes (the memory manager's `DeviceTally`), which sets itself as the chunks'
    `resident_watch`."""

    def resident_changed(self, chunk: Any, transient: bool) -> None:
        """What `chunk` holds where changed (only its transient buffers, when `transient`)."""
        ...


class Resident(Generic[T]):
    """A chunk attribute whose assignment is a resident change (see the module note).

    The value lives in the chunk's own `__dict__` under the attribute's name, and the
    descriptor has no `__get__` at run time: a data descriptor without one lets reads find the
    instance's value at the speed of a plain attribute (the memory manager reads these after
    every gather), while assignments still come here."""

    def __init__(self, *, transient: bool = False) -> None:
        self._transient = transient

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    if TYPE_CHECKING:

        def __get__(self, chunk: Any, owner: type | None = None) -> T: ...

    def __set__(self, holder: Any, value: T) -> None:
        holder.__dict__[self._name] = value
        # A part of a chunk (its gradient side) reports its changes as the chunk's.
        resident_changed(holder.__dict__.get("_resident_owner", holder), transient=self._transient)


def resident_changed(chunk: Any, *, transient: bool) -> None:
    """Tell `chunk`'s watcher, if it has one yet, that what it holds where changed (only its
    transient buffers, or not; see the module note)."""
    watch: ResidentWatch | None = chunk.__dict__.get("resident_watch")
    if watch is not None:
        watch.resident_changed(chunk, transient)
