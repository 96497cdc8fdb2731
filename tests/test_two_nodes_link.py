"""benchmarks/two_nodes.sh: two ranks as two nodes in network namespaces of their own, joined
by a veth pair whose token bucket limits each direction to the rate asked for. Proven: the
ranks meet over the pair (each on its own interface), an all-gather's values arrive, and at
200 Mbit/s a 16 MiB all-gather takes at least the time the link allows (the first 4 MiB pass
at once: the bucket), so the benchmarks run over it measure the link asked for. Needs root
and iproute2, as the script does; skipped without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RATE_BYTES_PER_S = 200e6 / 8
MIB = 16
BURST_MIB = 4


def _namespaces_work() -> bool:
    """Whether this process may make network namespaces (root, iproute2 and tc, and a
    container that grants CAP_NET_ADMIN)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    probe = f"swprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


@pytest.mark.skipif(
    not _namespaces_work(), reason="network namespaces need root, iproute2 and CAP_NET_ADMIN"
)
def test_two_nodes_meet_over_a_link_of_the_rate_asked_for(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    run = subprocess.run(
        [
            "bash",
            str(ROOT / "benchmarks" / "two_nodes.sh"),
            "200mbit",
            str(ROOT / "tests" / "two_nodes_probe.py"),
            "--mib",
            str(MIB),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["world"] == 2 and seen["values_right"]
    assert seen["interfaces"][0] != seen["interfaces"][1], seen["interfaces"]
    floor = (MIB - BURST_MIB) * 2**20 / RATE_BYTES_PER_S
    assert seen["seconds"] >= 0.9 * floor, (seen["seconds"], floor)
    # Nothing of the namespaces is left behind.
    nodes = re.search(r"two_nodes: nodes (\S+) and (\S+), link 200mbit", run.stderr)
    assert nodes is not None, run.stderr[-3000:]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not set(nodes.groups()) & set(namespaces.split()), namespaces
