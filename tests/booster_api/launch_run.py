"""Run under torchrun by test_launch_and_coordinator.py: a ColossalAI script's opening lines
(`launch_from_torch`, `DistCoordinator`) with `shardwise` for `colossalai`, each rank writing
what it saw to <out>/rank<r>.json."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

import shardwise
from shardwise.cluster import DistCoordinator

out = Path(sys.argv[1])
shardwise.launch_from_torch(seed=1234)
coordinator = DistCoordinator()
seen: dict[str, object] = {
    "rank": coordinator.rank,
    "world_size": coordinator.world_size,
    "local_rank": coordinator.local_rank,
    "is_master": coordinator.is_master(),
    "is_last": coordinator.is_last_process(),
    "same_object": DistCoordinator() is coordinator,
    "backend": torch.distributed.get_backend(),
    # Every generator seeded alike: the same draws on every rank.
    "draws": [random.random(), float(np.random.rand()), float(torch.rand(()))],
}
order = out / "order.txt"
with coordinator.priority_execution():
    if coordinator.is_master():
        time.sleep(0.5)  # a slow download: the others must still come after it
    with order.open("a") as file:
        file.write(f"{coordinator.rank}\n")


@coordinator.on_master_only()
def only_on_master() -> str:
    return "ran"


seen["on_master_only"] = only_on_master()
coordinator.print_on_master(f"printed by rank {coordinator.rank}")
coordinator.block_all()
(out / f"rank{coordinator.rank}.json").write_text(json.dumps(seen))
