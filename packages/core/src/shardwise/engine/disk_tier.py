"""Which chunks' optimizer sides go to the disk tier, and what a failed step restores.

The settings come from the placement (`Placement.disk_fraction`, `disk_dir`,
`host_budget_bytes`) and from a `HybridAdam`'s `nvme_offload_fraction` / `nvme_offload_dir`
(ColossalAI's spelling, given to the optimizer); both may be given only where they agree. The
fraction applies, as ColossalAI's NVMe offload does, to the optimizer state kept in host
memory: of the chunks whose optimizer side the placement put there, the first
floor(fraction x n) in chunk order go to the disk tier; a host budget then sends more, the last
in chunk order first, until the host memory the model state takes fits it.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from shardwise.chunk import Chunk, Pool
from shardwise.chunk.accounting import resident_bytes_by_pool
from shardwise.engine.config import Placement
from shardwise.logging.progress_bar import progress_bar, progress_wanted
from shardwise.memory.disk_pool import DiskPool, DiskTierError
from shardwise.memory.pages import give_back_freed_memory
from shardwise.optim import HybridAdam

_log = logging.getLogger(__name__)
# Optimizer state per element assumed before the optimizer has made any (Adam's two moments).
ASSUMED_STATE_BYTES = 8


@dataclass(frozen=True, slots=True)
class DiskSettings:
    """The disk tier's settings, merged from the placement and the optimizer."""

    fraction: float
    directory: str
    host_budget_bytes: int | None

    @property
    def wanted(self) -> bool:
        return self.fraction > 0 or self.host_budget_bytes is not None


def disk_settings(placement: Placement, optimizer: torch.optim.Optimizer) -> DiskSettings:
    """The placement's disk-tier settings and a `HybridAdam`'s NVMe ones, merged; refused
    where both are given and differ."""
    fraction, directory = placement.disk_fraction, placement.disk_dir
    if isinstance(optimizer, HybridAdam):
        nvme_fraction, nvme_dir = optimizer.claim_nvme_offload()
        if nvme_fraction and fraction and nvme_fraction != fraction:
            raise ValueError(
                f"HybridAdam(nvme_offload_fraction={nvme_fraction}) and the placement's disk "
                f"fraction {fraction} disagree; give it in one place"
            )
        if nvme_dir is not None and directory is not None and nvme_dir != directory:
            raise ValueError(
                f"HybridAdam(nvme_offload_dir={nvme_dir!r}) and the placement's disk directory "
                f"{directory!r} disagree; give it in one place"
            )
        fraction = fraction or nvme_fraction
        directory = directory or nvme_dir
    return DiskSettings(
        fraction=fraction,
        directory=directory or tempfile.gettempdir(),
        host_budget_bytes=placement.host_budget_bytes,
    )


def chunks_for_disk(
    chunks: list[Chunk], settings: DiskSettings, *, already: int = 0, planned: bool = False
) -> list[Chunk]:
    """The chunks whose optimizer side goes to the disk tier (see the module's docstring);
    refused where no optimizer side is in host memory to take from, unless `already` chunks
    are on the disk tier (left there by an optimizer before) or the placement plans against
    the device's room (`planned`: "auto", whose plan found room on the device for every
    side, see [Note: auto places from the wrap] in gemini/wrap_plan.py)."""
    held = [chunk for chunk in chunks if chunk.placement.optim is Pool.HOST]
    if not held and planned:
        _log.info(
            "the disk tier takes nothing: placement 'auto' keeps every optimizer side on the device"
        )
        return []
    if not held and already:
        return []
    if not held:
        raise ValueError(
            f"the disk tier (nvme_offload_fraction={settings.fraction}, host_budget_bytes="
            f"{settings.host_budget_bytes}) takes optimizer state kept in host memory, and this "
            f"placement keeps none there: use placement_policy='cpu' (stage 3, or stages 1-2 "
            f"with cpu_offload=True), 'auto', or 'static' with offload_optim_frac > 0"
        )
    chosen = held[: math.floor(settings.fraction * len(held))]
    if settings.fraction > 0 and not chosen:
        _log.warning(
            "nvme_offload_fraction=%s of %d optimizer sides in host memory is none of them; "
            "raise it to at least %.3g to use the disk tier",
            settings.fraction,
            len(held),
            1 / len(held),
        )
    budget = settings.host_budget_bytes
    if budget is not None:
        host = sum(_host_bytes(chunk, on_disk=chunk in chosen) for chunk in chunks)
        for chunk in reversed(held):
            if host <= budget:
                break
            if chunk not in chosen:
                host -= _host_bytes(chunk, on_disk=False) - _host_bytes(chunk, on_disk=True)
                chosen.append(chunk)
        if host > budget:
            _log.warning(
                "host_budget_bytes=%d: %d bytes of model state stay in host memory with every "
                "optimizer side on the disk tier (payload shards and gradient shards cannot "
                "go there)",
                budget,
                host,
            )
    return sorted(chosen, key=lambda chunk: chunk.chunk_id)


def _host_bytes(chunk: Chunk, *, on_disk: bool) -> int:
    """Host memory `chunk`'s model state takes, with its optimizer side in host memory or on
    the disk tier (its state assumed Adam's before the optimizer made it)."""
    held = resident_bytes_by_pool(chunk)[Pool.HOST]
    if chunk.placement.optim is not Pool.HOST:
        return held
    if on_disk:
        return held - (0 if chunk.master is chunk.payload.shard else _nbytes(chunk.master))
    state = chunk.optimizer_state.nbytes() or ASSUMED_STATE_BYTES * chunk.shard_numel
    return held + state


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def place_on_disk(chunks: list[Chunk], disk: DiskPool) -> DiskPool:
    """`disk` holding `chunks`' masters and state too. Its files go when it is closed
    (`release_disk`, the optimizer's `close()`), when it is collected (every chunk on it is:
    an optimizer collected without `close()` leaves the masters there for the model) or when
    the process exits."""
    # Progress for a big model, whose first write of every master and state takes minutes:
    # logged at each tenth, and drawn on rank 0's bar (see [Note: when the bar shows]).
    started, total, every = time.perf_counter(), len(chunks), max(1, len(chunks) // 10)
    _log.info("placing %d chunks' masters and optimizer state in %s", total, disk.path)
    bar = progress_bar(total, "disk tier write", shown=progress_wanted(), unit="chunk")
    try:
        for done, chunk in enumerate(chunks, 1):
            chunk.move_optim(Pool.DISK, disk=disk)
            bar.update(1)
            if done % every == 0 or done == total:
                _log.info(
                    "disk tier: %d of %d chunks written (%.1f s)",
                    done, total, time.perf_counter() - started,
                )  # fmt: skip
    except BaseException:
        release_disk(chunks, disk)
        raise
    finally:
        bar.close()
    give_back_freed_memory()  # the masters written out
    return disk


def release_disk(chunks: list[Chunk], disk: DiskPool) -> None:
    """Bring `chunks`' masters and state back into host memory and remove the files (the
    optimizer is closed: the model keeps its fp32 masters)."""
    try:
        for chunk in chunks:
            if chunk.placement.optim is Pool.DISK and chunk.placement.disk is disk:
                chunk.move_optim(Pool.HOST)
    finally:
        disk.close()


def disk_chunks_for(
    chunks: list[Chunk],
    placement: Placement,
    optimizer: torch.optim.Optimizer,
    rank: int,
) -> tuple[list[Chunk], DiskPool | None]:
    """The chunks (in chunk order) whose optimizer sides live on the disk tier, and its pool:
    those an optimizer before this one left there (it was collected without `close()`: their
    masters wait there still), and those the settings send there now."""
    on_disk = [c for c in chunks if c.placement.optim is Pool.DISK]
    disk = on_disk[0].placement.disk if on_disk else None
    settings = disk_settings(placement, optimizer)
    if not settings.wanted:
        return on_disk, disk
    chosen = chunks_for_disk(
        chunks, settings, already=len(on_disk), planned=placement.policy.name == "auto"
    )
    if not chosen:
        return on_disk, disk
    disk = place_on_disk(chosen, disk or DiskPool(settings.directory, rank=rank))
    return sorted([*on_disk, *chosen], key=lambda chunk: chunk.chunk_id), disk


@contextmanager
def sides_in_memory(disk_chunks: list[Chunk]) -> Iterator[None]:
    """Every master and optimizer state of `disk_chunks` readable in memory inside the block,
    dropped again on leaving (their disk copies unchanged)."""
    with ExitStack() as stack:
        for chunk in disk_chunks:
            stack.enter_context(chunk.optim_side_in_memory(write_back=False))
        yield


def cloned_state(state: dict[Any, Any]) -> dict[Any, Any]:
    """A state dict's per-parameter state with its tensors copied (the originals of the disk
    tier's chunks lose their memory when written out again)."""
    return {
        key: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for key, entry in state.items()
    }


def adopt_replaced_state(chunks: list[Chunk], state: dict[Any, Any]) -> None:
    """The inner optimizer's `state` was replaced (loaded): each chunk adopts its new tensors
    (see [Note: the chunk owns its optimizer state] in chunk/optimizer_state.py); a chunk on
    the disk tier writes them through at once, so its disk copy holds the loaded state."""
    for chunk in chunks:
        states = chunk.optimizer_state
        on_disk = chunk.placement.optim is Pool.DISK
        if on_disk:
            chunk.ensure_resident()
        states.adopt(state.get(view, {}) for view, _, _ in states.views)
        if on_disk:
            try:
                chunk.tier.evict().result()
            except OSError as error:
                raise DiskTierError(
                    f"the loaded optimizer state of chunk {chunk.chunk_id} could not be "
                    f"written to the disk tier ({error}); it stays in memory until the "
                    f"next step writes it"
                ) from error
            chunk.tier.commit()


@dataclass(slots=True)
class StepSnapshot:
    """What a step of the disk tier's chunks changes besides their master and state (which
    their disk copies keep): the optimizer's per-view state entries (scalar step counts, and
    which views have state at all), each chunk's adopted state tensors, and the loss scaler.
    Restored when the step rolls back (see [Note: the disk tier in the step] in
    step_loop.py)."""

    views: list[tuple[torch.Tensor, dict[str, Any] | None]]
    adopted: list[tuple[Chunk, list[torch.Tensor]]]
    scaler: dict[str, Any]

    @classmethod
    def take(
        cls, chunks: list[Chunk], state: dict[Any, Any], scaler: dict[str, Any]
    ) -> StepSnapshot:
        views = []
        adopted = []
        for chunk in chunks:
            kept = {id(t) for t in chunk.optimizer_state.tensors}
            adopted.append((chunk, list(chunk.optimizer_state.tensors)))
            for view, _, _ in chunk.optimizer_state.views:
                entry = state.get(view)
                views.append(
                    (
                        view,
                        None
                        if entry is None
                        else {
                            key: value.clone()
                            if isinstance(value, torch.Tensor) and id(value) not in kept
                            else value
                            for key, value in entry.items()
                        },
                    )
                )
        return cls(views=views, adopted=adopted, scaler=scaler)

    def restore(self, state: dict[Any, Any]) -> None:
        for view, entry in self.views:
            if entry is None:
                state.pop(view, None)
            else:
                state[view] = entry
        for chunk, tensors in self.adopted:
            chunk.optimizer_state.restore(tensors)
