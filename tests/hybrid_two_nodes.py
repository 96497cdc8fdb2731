"""Runs on two torchrun agents as two nodes of two ranks (c10d rendezvous, gloo): hybrid
sharding at stage 3 with `shard_size` the ranks per node, against DDP over the same 4 ranks;
a checkpoint saved at that layout and loaded into full sharding over all 4 ranks at stage 2;
hpZ (`secondary_shard_size` the ranks per node) against the same DDP run; writes what rank 0
saw as JSON.

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \
        --rdzv-id=ID tests/hybrid_two_nodes.py OUT_DIR

OUT_DIR must be one directory both nodes see (here: one host), as a checkpoint's must be.
The reference is the plain loop a user runs without shardwise: DistributedDataParallel over the
4 ranks, AdamW, `zero_grad()`, `backward()`, `step()`, same seed and per-rank batches.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.checkpoint import load, save
from shardwise.comm import CommOp

WIDTH = 24
STEPS = 4
ROWS_PER_RANK = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, 2 * WIDTH)
        self.mid = nn.Linear(2 * WIDTH, 2 * WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


# A fixed linear map the model learns.
TEACHER = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(1)) / WIDTH**0.5


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch, the same on every rank; this rank's rows of it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(10 + step)
    x = torch.randn(world * ROWS_PER_RANK, WIDTH, generator=generator)
    y = x @ TEACHER
    part = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return x[part], y[part]


def mean_loss(loss: torch.Tensor) -> float:
    """The loss averaged over the 4 ranks, as the whole batch's."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def plain(steps: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """DDP: the losses, the weights after `STEPS` steps and after `steps`."""
    torch.manual_seed(0)
    model = Net()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, at_steps = [], {}
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = (ddp(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(mean_loss(loss))
        if step + 1 == STEPS:
            at_steps = {k: v.clone() for k, v in model.state_dict().items()}
    return losses, at_steps, model.state_dict()


def wrapped(
    stage: int, shard_size: int | None, chunk: int, secondary_shard_size: int | None = None
) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = Net()
    config: dict[str, Any] = {"device": torch.device("cpu"), "shard_size": shard_size}
    if secondary_shard_size is not None:
        config["secondary_shard_size"] = secondary_shard_size
    if stage == 3:
        config["chunk_size_numel"] = chunk
    engine = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        engine,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        optim_config={"reduce_bucket_size": chunk} if stage < 3 else None,
    )
    return engine, optimizer


def train_step(engine: Any, optimizer: Any, step: int) -> float:
    x, y = batch(step)
    optimizer.zero_grad()
    loss = (engine(x) - y).pow(2).mean()
    optimizer.backward(loss)
    optimizer.step()
    return mean_loss(loss)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    placement = {
        "rank": rank,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "local_world_size": per_node,
        "agent_pid": os.getppid(),  # the torchrun agent ("node") that started this rank
    }
    placements: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(placements, placement)

    # One step more than saved: the step after the reload checks the optimizer state too.
    plain_losses, plain_final, plain_next = plain(STEPS + 1)

    # Hybrid: sharded over this node's ranks, replicated across the two nodes.
    engine, optimizer = wrapped(3, shard_size=per_node, chunk=1000)
    topology = engine.chunk_manager.topology
    shard_group = dist.get_process_group_ranks(topology.shard)
    shard_groups: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shard_groups, shard_group)
    losses = [train_step(engine, optimizer, step) for step in range(STEPS)]
    final = engine.state_dict(only_rank_0=False)
    save(out / "checkpoint", engine, optimizer, extra={"step": STEPS, "shard_size": per_node})

    # The same checkpoint, full sharding over all 4 ranks at stage 2 (other bucket size).
    other, other_optimizer = wrapped(2, shard_size=None, chunk=700)
    extra = load(out / "checkpoint", other, other_optimizer)
    loaded = other.state_dict(only_rank_0=False)
    reload_same = all(torch.equal(loaded[k], v) for k, v in final.items())
    # One more step on each: equal only if the AdamW moments and step count came back.
    next_hybrid = train_step(engine, optimizer, STEPS)
    next_loaded = train_step(other, other_optimizer, STEPS)
    after_hybrid = engine.state_dict(only_rank_0=False)
    after_loaded = other.state_dict(only_rank_0=False)

    # hpZ: sharded over all 4 ranks, backward's gathers inside each node.
    hpz, hpz_optimizer = wrapped(3, shard_size=None, chunk=1000, secondary_shard_size=per_node)
    secondary = hpz.chunk_manager.topology.secondary
    secondary_groups: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(secondary_groups, dist.get_process_group_ranks(secondary))
    hpz_losses = [train_step(hpz, hpz_optimizer, step) for step in range(STEPS)]
    hpz_final = hpz.state_dict(only_rank_0=False)

    seen = {
        "hpz_secondary_groups": secondary_groups,
        "hpz_chunk_world": sorted({c.world_size for c in hpz.chunk_manager.chunks}),
        "hpz_secondary_gathers": hpz.comm_stats.calls(CommOp.SECONDARY_ALL_GATHER),
        "hpz_losses": hpz_losses,
        "hpz_diff": max_diff(hpz_final, plain_final),
        "world_size": dist.get_world_size(),
        "placements": placements,
        "shard_groups": shard_groups,
        "replicas": topology.replicas,
        "chunk_world": sorted({c.world_size for c in engine.chunk_manager.chunks}),
        "other_chunk_world": sorted({c.world_size for c in other.chunk_manager.chunks}),
        "losses": losses,
        "plain_losses": plain_losses[:STEPS],
        "diff": max_diff(final, plain_final),
        "extra": extra,
        "reload_same": reload_same,
        "reload_keys_same": sorted(loaded) == sorted(final),
        "next_losses": [next_hybrid, next_loaded, plain_losses[STEPS]],
        "next_diff_loaded": max_diff(after_loaded, after_hybrid),
        "next_diff_plain": max_diff(after_hybrid, plain_next),
        "checkpoint_files": sorted(p.name for p in (out / "checkpoint").iterdir()),
    }
    if rank == 0:
        (out / "seen.json").write_text(json.dumps(seen, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
