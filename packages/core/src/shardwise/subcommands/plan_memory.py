"""`shardwise plan`'s device and host memory per rank: as given, or detected on this machine.

[Note: detected memory per rank]
Without --device-memory / --host-memory the planner plans for this machine. A CUDA device's
capacity is one rank's own (torchrun starts one rank per device). The host's memory is shared
by the ranks on it, so each rank is credited the host's memory divided by the ranks per node:
--ranks-per-node when given, else one rank per CUDA device here (at most the world size), else,
without CUDA, the world size (CPU runs start every rank on one host: the cautious answer).
Without CUDA the CPU computes from that same share, which the plan then counts as both device
and host memory. The line that reports the detected memory says which rule divided it.
"""

from __future__ import annotations

import argparse
import os

from shardwise.subcommands.arguments import gb


def memory_per_rank(args: argparse.Namespace) -> tuple[int, int, int | None, str | None]:
    """Device and host memory per rank, as given or detected (see [Note: detected memory per
    rank]), the ranks per node detected host memory was divided by (None where none was), and
    the line reporting what was detected (None where nothing was)."""
    given_device, given_host = args.device_memory, args.host_memory
    if given_device is not None and given_host is not None:
        if args.ranks_per_node is not None:
            raise ValueError(
                "--ranks-per-node divides this host's detected memory, but --device-memory and "
                "--host-memory are both given: leave --ranks-per-node out"
            )
        return given_device, given_host, None, None
    device, host, num_devices, where = _detected_memory()
    if given_host is not None and device is not None:
        # Only the CUDA device's capacity is detected: one rank's own, nothing to divide.
        if args.ranks_per_node is not None:
            raise ValueError(
                "--ranks-per-node divides this host's detected memory, but --host-memory is "
                "given and the device memory is the CUDA device's own: leave --ranks-per-node out"
            )
        return device, given_host, None, (
            f"planning with {where}: device {gb(device)} per rank (one rank per device; pass "
            f"--device-memory to plan for another device)"
        )  # fmt: skip
    if args.ranks_per_node is not None:
        ranks, rule = args.ranks_per_node, "--ranks-per-node"
        if ranks > args.world_size:
            raise ValueError(f"--ranks-per-node ({ranks}) exceeds --world-size ({args.world_size})")
    elif num_devices:
        ranks = min(args.world_size, num_devices)
        rule = f"one per CUDA device here ({num_devices}), at most --world-size"
    else:
        ranks, rule = args.world_size, "--world-size: without CUDA every rank runs on this host"
    share = host // ranks
    divided = f"this host's {gb(host)} / {ranks} ranks per node ({rule}) = {gb(share)} per rank"
    host_memory = share if given_host is None else given_host
    if given_device is not None:
        device_memory, said = given_device, f"host: {divided}"
    elif device is not None:
        device_memory = device
        said = f"device: {gb(device)} per rank (one rank per device); host: {divided}"
    elif given_host is not None:
        device_memory, said = share, f"device: {divided}"
    else:
        # [Note: detected memory per rank]: the CPU computes from the rank's host share.
        device_memory, said = share, f"device and host: {divided}, counted as both"
    return device_memory, host_memory, ranks, (
        f"planning with {where}: {said} (--ranks-per-node changes the ranks per node; "
        f"--device-memory / --host-memory plan for another machine)"
    )  # fmt: skip


def _detected_memory() -> tuple[int | None, int, int, str]:
    """This machine's memory: the first CUDA device's capacity (None without CUDA: the CPU
    computes from host memory), the host's memory, the CUDA devices' count, and the name the
    output gives them."""
    import torch

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        name = f"this machine's {properties.name}"
        return int(properties.total_memory), host, torch.cuda.device_count(), name
    return None, host, 0, "this host's memory (no CUDA device: the CPU computes)"
