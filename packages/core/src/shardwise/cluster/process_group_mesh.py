"""ProcessGroupMesh (ColossalAI's `colossalai.cluster.ProcessGroupMesh`): the ranks laid out as
an n-dimensional mesh in row-major order, and the process groups along its axes, made once
and kept (data-parallel meshes: the replicas and shards of hybrid sharding are two axes)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup


class ProcessGroupMesh:
    """The world's ranks as a mesh of shape `size` (rank r at the row-major coordinate of r).

    Args:
        *size: the mesh's extent along each axis; their product is the world size.
    """

    def __init__(self, *size: int) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupMesh needs torch.distributed initialised: call "
                "shardwise.launch_from_torch() first"
            )
        if not size or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in size):
            raise ValueError(f"the mesh's sizes must be positive ints, got {size}")
        world = dist.get_world_size()
        if math.prod(size) != world:
            raise ValueError(
                f"the mesh {size} holds {math.prod(size)} ranks, the world has {world}: the "
                f"product of the sizes must be the world size"
            )
        self._shape = tuple(size)
        self._rank = dist.get_rank()
        self._coord = self.unravel(self._rank, self._shape)
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}
        self._ranks_of: dict[ProcessGroup, tuple[int, ...]] = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def rank(self) -> int:
        return self._rank

    def size(self, dim: int | None = None) -> int | tuple[int, ...]:
        """The mesh's shape, or its extent along `dim`."""
        return self._shape if dim is None else self._shape[dim]

    def coordinate(self, dim: int | None = None) -> int | tuple[int, ...]:
        """This rank's coordinate, or its index along `dim`."""
        return self._coord if dim is None else self._coord[dim]

    @staticmethod
    def unravel(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The row-major coordinate of `rank` in a mesh of `shape`."""
        coord = []
        for extent in reversed(shape):
            rank, index = divmod(rank, extent)
            coord.append(index)
        return tuple(reversed(coord))

    @staticmethod
    def ravel(coord: Sequence[int], shape: tuple[int, ...], mode: str = "raise") -> int:
        """The rank at `coord` ("wrap" takes each index modulo its extent, "clip" clamps it,
        "raise" refuses one outside the mesh)."""
        if mode not in ("raise", "wrap", "clip"):
            raise ValueError(f"mode must be 'raise', 'wrap' or 'clip', got {mode!r}")
        rank = 0
        for index, extent in zip(coord, shape, strict=True):
            if mode == "wrap":
                index %= extent
            elif mode == "clip":
                index = min(max(index, 0), extent - 1)
            elif not 0 <= index < extent:
                raise ValueError(f"coordinate {tuple(coord)} is outside the mesh {shape}")
            rank = rank * extent + index
        return rank

    def get_ranks_in_group(self, group: ProcessGroup) -> list[int]:
        """The ranks of a group this mesh made."""
        return list(self._ranks_of[group])

    def create_group_along_axis(
        self,
        axis: int | list[int],
        indices_at_axis: list[int] | list[list[int]] | None = None,
        backend: str | None = None,
    ) -> ProcessGroup:
        """Make every group along `axis` (each: the ranks that differ only there, at
        `indices_at_axis`, every index when None), on every rank, and return this rank's.

        Args:
            axis: an axis, or several (the groups then span them together).
            indices_at_axis: the indices along each axis that the groups take.
            backend: the groups' backend (None: the default group's).
        """
        axes, indices = self._axes_and_indices(axis, indices_at_axis)
        mine: ProcessGroup | None = None
        others = [
            range(1) if ax in axes else range(extent) for ax, extent in enumerate(self._shape)
        ]
        for base in itertools.product(*others):
            ranks = self._ranks_along(base, axes, indices)
            group = self._group(ranks, backend)
            if self._rank in ranks:
                mine = group
        if mine is None:
            raise ValueError(
                f"rank {self._rank} is in none of the groups along {axis} at {indices_at_axis}"
            )
        return mine

    def get_group_along_axis(
        self,
        axis: int | list[int],
        indices_at_axis: list[int] | list[list[int]] | None = None,
        backend: str | None = None,
    ) -> ProcessGroup:
        """This rank's group along `axis` (made on every rank the first time: a collective
        then).

        Args:
            axis, indices_at_axis, backend: as `create_group_along_axis`'s.
        """
        axes, indices = self._axes_and_indices(axis, indices_at_axis)
        ranks = self._ranks_along(self._coord, axes, indices)
        if ranks in self._groups:
            return self._groups[ranks]
        return self.create_group_along_axis(axis, indices_at_axis, backend)

    def destroy_mesh_process_groups(self) -> None:
        """Destroy the groups this mesh made."""
        for group in self._ranks_of:
            dist.destroy_process_group(group)
        self._groups.clear()
        self._ranks_of.clear()

    def _axes_and_indices(
        self, axis: int | list[int], indices_at_axis: list[int] | list[list[int]] | None
    ) -> tuple[list[int], list[list[int]]]:
        axes = [axis] if isinstance(axis, int) else list(axis)
        for ax in axes:
            if not 0 <= ax < len(self._shape):
                raise ValueError(f"axis {ax} is outside the mesh {self._shape}")
        if indices_at_axis is None:
            return axes, [list(range(self._shape[ax])) for ax in axes]
        if isinstance(axis, int):
            return axes, [list(indices_at_axis)]  # type: ignore[arg-type]
        return axes, [list(indices) for indices in indices_at_axis]  # type: ignore[arg-type]

    def _ranks_along(
        self, base: Sequence[int], axes: list[int], indices: list[list[int]]
    ) -> tuple[int, ...]:
        coords = [list(base)]
        for ax, at in zip(axes, indices, strict=True):
            coords = [[*c[:ax], i, *c[ax + 1 :]] for c in coords for i in at]
        return tuple(sorted(self.ravel(c, self._shape) for c in coords))

    def _group(self, ranks: tuple[int, ...], backend: str | None) -> ProcessGroup:
        if ranks not in self._groups:
            # Every rank makes every group, in the same order (new_group is a collective); a
            # rank outside one gets a placeholder, kept only to answer "made already".
            group = dist.new_group(list(ranks), backend=backend)
            self._groups[ranks] = group
            if self._rank in ranks:
                self._ranks_of[group] = ranks
        return self._groups[ranks]
