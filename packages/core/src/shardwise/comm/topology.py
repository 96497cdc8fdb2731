"""Which ranks shard a model among themselves and which hold replicas of the same shards.

[Note: hybrid sharding]
With `shard_size` s over a data-parallel group of N ranks (N a multiple of s), the ranks form
N / s shard groups of s consecutive ranks (e.g. one node each) and s replicate groups of the
ranks at the same position in every shard group. Parameters, gradients and optimizer state are
sharded over a shard group, as plain ZeRO shards them over all N, and each shard group holds a
full replica. All-gathers and reduce-scatters stay inside a shard group (fast links); before
the step reads them, each rank's gradient shard (the sum of the backward passes since
`zero_grad()`) is all-reduced with the ranks holding the same shard in the other groups and
averaged over all N, in one all-reduce (chunk/reduction.py, `reduce_across_replicas`), so every
replica steps alike: the slow links carry one shard's gradient per rank and step, 2 (R - 1) / R
of it with R = N / s replicas (a ring all-reduce), however many passes accumulated, instead of
every gather and reduction of the pass. Doing it at the step, not after each reduction, also
keeps it where every rank's sequence of collectives agrees: the memory manager finishes
reductions when its own rank needs room.

What every rank must agree on (passes, steps, which tensors got gradients, the gradient norm)
is still decided over the whole data-parallel group.

A shard size of 1 is stage 0's topology (`replicated`): each rank is a shard group of its own,
holding the whole model, and every other rank a replica. ColoDDP averages its gradients across
the replicas during backward rather than before a step (see [Note: stage 0] in
chunk/reduction.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardwise.comm.collectives import rank, world_size


@dataclass(frozen=True, slots=True)
class Topology:
    """The groups a model's collectives run on.

    Attributes:
        data_parallel: every rank training the model (None: the default group).
        shard: the ranks this rank shards the model with (the data-parallel group itself
            without hybrid sharding).
        replicate: the ranks holding the same shards as this one in the other shard groups;
            None without hybrid sharding.
        replicas: how many shard groups there are (1 without hybrid sharding).
        secondary: ZeRO++ hpZ: the ranks this rank keeps secondary shards with, for
            backward's gathers (see [Note: secondary shards] in chunk/chunk.py); None without.
    """

    data_parallel: ProcessGroup | None
    shard: ProcessGroup | None
    replicate: ProcessGroup | None
    replicas: int
    secondary: ProcessGroup | None = None

    @property
    def hybrid(self) -> bool:
        return self.replicate is not None


# Per default group (by identity) and shard size: a process that builds a new default group
# builds new subgroups.
_BUILT: dict[tuple[int, int], Topology] = {}


def topology_for(
    group: ProcessGroup | None, shard_size: int | None, *, secondary_shard_size: int | None = None
) -> Topology:
    """The topology of `group` sharded in groups of `shard_size` ranks (None: over all of it)
    and, with `secondary_shard_size`, the groups hpZ's secondary shards live in (see
    [Note: secondary shards] in chunk/chunk.py)."""
    if secondary_shard_size is None:
        return _shard_topology(group, shard_size)
    if shard_size is not None:
        raise ValueError("secondary_shard_size and shard_size cannot be combined")
    topology = _shard_topology(group, None)
    return replace(topology, secondary=secondary_group(group, secondary_shard_size))


def _shard_topology(group: ProcessGroup | None, shard_size: int | None) -> Topology:
    """The topology of `group` sharded in groups of `shard_size` ranks (None: over all of it).

    Building the subgroups is a collective over the default group (every rank creates every
    subgroup); a topology is built once per size and reused by every model that asks again.
    A shard size of 1 needs no subgroup but each rank's own (see `replicated`), so it works
    with any `group`.
    """
    if shard_size is None:
        return Topology(data_parallel=group, shard=group, replicate=None, replicas=1)
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be a positive int of ranks, got {shard_size!r}")
    world = world_size(group)
    if world % shard_size:
        raise ValueError(
            f"shard_size={shard_size} does not divide the {world} data-parallel ranks; use a "
            f"divisor (e.g. the ranks per node) or leave it unset to shard over all of them"
        )
    if shard_size == world:
        return Topology(data_parallel=group, shard=group, replicate=None, replicas=1)
    if shard_size == 1:
        return replicated(group)
    if group is not None and group is not dist.group.WORLD:
        raise ValueError(
            "shard_size splits the default process group; with a process_group of your own, "
            "build the shard groups yourself and pass the shard group as process_group"
        )
    key = (id(dist.group.WORLD), shard_size)
    built = _BUILT.get(key)
    if built is not None:
        return built
    replicas = world // shard_size
    shard_ranks = [list(range(g * shard_size, (g + 1) * shard_size)) for g in range(replicas)]
    replicate_ranks = [list(range(p, world, shard_size)) for p in range(shard_size)]
    shard, _ = dist.new_subgroups_by_enumeration(shard_ranks)
    replicate, _ = dist.new_subgroups_by_enumeration(replicate_ranks)
    built = Topology(data_parallel=group, shard=shard, replicate=replicate, replicas=replicas)
    _BUILT[key] = built
    return built


def replicated(group: ProcessGroup | None) -> Topology:
    """Stage 0's topology: every rank of `group` (None: the default group) holds the whole
    model, as a shard group of its own, and the whole of `group` are its replicas. `group`
    may be any process group: the one-rank group is made by this rank alone, the others
    taking no part."""
    world = world_size(group)
    if world == 1:
        return Topology(data_parallel=group, shard=group, replicate=None, replicas=1)
    # The default group by name: None would read as "no replicas" (see Topology.hybrid).
    replicate = group if group is not None else dist.group.WORLD
    assert replicate is not None
    return Topology(data_parallel=group, shard=_own_group(), replicate=replicate, replicas=world)


# Per default group (by identity), this rank's one-rank group.
_OWN: dict[int, ProcessGroup] = {}


def _own_group() -> ProcessGroup:
    key = id(dist.group.WORLD)
    own = _OWN.get(key)
    if own is None:
        own = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        assert own is not None
        _OWN[key] = own
    return own


def replica_index(topology: Topology) -> int:
    """Which shard group this rank belongs to (0 without hybrid sharding)."""
    return rank(topology.replicate) if topology.replicate is not None else 0


# Per default group (by identity) and size: every rank's secondary group.
_SECONDARY: dict[tuple[int, int], ProcessGroup] = {}


def secondary_group(group: ProcessGroup | None, size: int) -> ProcessGroup:
    """This rank's group of `size` consecutive ranks of the default group (a node's ranks),
    where hpZ keeps its secondary shards. A collective over the default group the first time
    a size is asked for (every rank creates every subgroup)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"secondary_shard_size must be a positive int of ranks, got {size!r}")
    if group is not None and group is not dist.group.WORLD:
        raise ValueError(
            "secondary_shard_size splits the default process group; it cannot be combined "
            "with a process_group of your own"
        )
    world = world_size(group)
    if world % size or size >= world:
        raise ValueError(
            f"secondary_shard_size={size} must be a divisor of the {world} ranks smaller than "
            f"{world} (e.g. the ranks per node); at {world} it would gather over every rank, "
            f"as without it"
        )
    key = (id(dist.group.WORLD), size)
    built = _SECONDARY.get(key)
    if built is None:
        ranks = [list(range(g * size, (g + 1) * size)) for g in range(world // size)]
        built, _ = dist.new_subgroups_by_enumeration(ranks)
        assert built is not None
        _SECONDARY[key] = built
    return built
