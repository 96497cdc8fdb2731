"""Run by tests/test_two_nodes_link.py under benchmarks/two_nodes.sh: each rank all-gathers
`--mib` MiB and rank 0 writes what it saw (the time, the values, each rank's interface)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = args.mib * 2**20 // 4
    mine = torch.full((numel,), float(rank + 1))
    gathered = torch.empty(world * numel)
    dist.barrier()
    start = time.perf_counter()
    dist.all_gather_into_tensor(gathered, mine)
    seconds = time.perf_counter() - start
    interfaces: list[object] = [None] * world
    dist.all_gather_object(interfaces, os.environ.get("GLOO_SOCKET_IFNAME"))
    expected = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(numel)
    if rank == 0:
        with open(args.out, "w") as file:
            json.dump(
                {
                    "world": world,
                    "seconds": seconds,
                    "values_right": bool(torch.equal(gathered, expected)),
                    "interfaces": interfaces,
                },
                file,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
