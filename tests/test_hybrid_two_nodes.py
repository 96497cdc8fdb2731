"""Hybrid sharding launched as a user launches two nodes: two torchrun agents on this host,
`--nnodes=2 --nproc-per-node=2`, meeting through a c10d rendezvous (tests/hybrid_two_nodes.py).

Proven: with `shard_size=2`, the ranks per node, each node's two ranks form one shard group
(whatever agent the rendezvous made node 0) and the two nodes replicate each other; stage 3
trains as DDP over the same 4 ranks does, the reference being the plain loop a user runs
without shardwise (DistributedDataParallel, AdamW, same seed and batches): DDP sums each
gradient over 4 ranks in one all-reduce, hybrid sharding over the 2 ranks of a node and then
across the nodes, so the sums associate differently: fp32 within 1e-6 (measured 3.3e-7; the
losses agree to 1e-6 relative, the first bit for bit). A checkpoint saved at
that layout loads into full sharding over all 4 ranks at stage 2 exactly, optimizer state
included (the next step agrees).

c10d rendezvous ignores `--node-rank` (only the static rendezvous reads it): the rendezvous
assigns each agent its GROUP_RANK, and with it the global ranks of its workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 180
SHUTDOWN_S = 5


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(stat.parent.name))
    return found


def _stop(agents: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each agent, which stops its workers (SIGKILL after SHUTDOWN_S); an agent
    still running after that is killed with its workers, by id (they run in sessions of their
    own, out of the agent's process group)."""
    for agent in agents:
        if agent.poll() is None:
            agent.terminate()
    for agent in agents:
        try:
            agent.wait(timeout=SHUTDOWN_S + 10)
        except subprocess.TimeoutExpired:
            for child in _children(agent.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            agent.kill()
            agent.wait()


def _tail(path: Path) -> str:
    """The workers' own lines (their tracebacks, prefixed `[rankN]:`), then the agent's last."""
    text = path.read_text(errors="replace")
    workers = "\n".join(line for line in text.splitlines() if line.startswith("[rank"))
    return f"{workers[-2500:]}\n...\n{text[-1500:]}"


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both agents started before either is waited for; both stopped, with their workers, when
    one outlives the deadline."""
    out = tmp_path_factory.mktemp("hybrid_two_nodes")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    endpoint = f"127.0.0.1:{_free_port()}"
    run_id = uuid.uuid4().hex
    agents, logs = [], []
    for node in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            # On one host both agents match the endpoint's address: say which hosts the store.
            f"--rdzv-conf=is_host={int(node == 0)}",
            "--local-addr=127.0.0.1", "--max-restarts=0", f"--shutdown-timeout={SHUTDOWN_S}",
            str(HERE / "hybrid_two_nodes.py"), str(out),
        ]  # fmt: skip
        stdout, stderr = out / f"agent{node}.out", out / f"agent{node}.err"
        with stdout.open("w") as o, stderr.open("w") as e:
            agents.append(subprocess.Popen(command, stdout=o, stderr=e, env=environment))
        logs.append(stderr)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        codes = [agent.wait(timeout=max(deadline - time.monotonic(), 1)) for agent in agents]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        _stop(agents)
    tails = "\n".join(f"--- agent {n} stderr ---\n{_tail(log)}" for n, log in enumerate(logs))
    assert codes is not None, f"timed out after {TIMEOUT_S} s\n{tails}"
    assert codes == [0, 0], f"return codes {codes}\n{tails}"
    seen: dict[str, Any] = json.loads((out / "seen.json").read_text())
    seen["agent_pids"] = [agent.pid for agent in agents]
    return seen


def test_each_node_holds_one_shard_group(launched: dict[str, Any]) -> None:
    assert launched["world_size"] == 4
    nodes: dict[int, list[int]] = {}
    for placement in launched["placements"]:
        assert placement["local_world_size"] == 2
        # Global rank from the rendezvous: the agent's rank, then the worker's on its node.
        assert placement["rank"] == 2 * placement["group_rank"] + placement["local_rank"]
        nodes.setdefault(placement["agent_pid"], []).append(placement["rank"])
    # Two agents, these two, each the parent of two consecutive ranks.
    assert sorted(nodes) == sorted(launched["agent_pids"])
    assert sorted(sorted(ranks) for ranks in nodes.values()) == [[0, 1], [2, 3]]
    # The shard group of every rank is its node's ranks; the nodes are the replicas.
    for placement, group in zip(launched["placements"], launched["shard_groups"], strict=True):
        assert sorted(group) == sorted(nodes[placement["agent_pid"]])
    assert launched["replicas"] == 2
    assert launched["chunk_world"] == [2]  # sharded over a node, not all 4 ranks


def test_trains_as_ddp_over_both_nodes(launched: dict[str, Any]) -> None:
    assert launched["diff"] < 1e-6, launched["diff"]
    # The first loss is computed before any update: bit for bit.
    assert launched["losses"][0] == launched["plain_losses"][0]
    for mine, plain in zip(launched["losses"], launched["plain_losses"], strict=True):
        assert abs(mine - plain) <= 1e-6 * abs(plain), (
            launched["losses"],
            launched["plain_losses"],
        )


def test_checkpoint_loads_into_full_sharding_at_stage_2(launched: dict[str, Any]) -> None:
    # Node 0's shard group wrote the checkpoint, one file per rank; node 1 holds the same.
    assert launched["checkpoint_files"] == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest.json",
    ]
    assert launched["other_chunk_world"] == [4]
    assert launched["extra"] == {"step": 4, "shard_size": 2}
    assert launched["reload_keys_same"] and launched["reload_same"]
    # The step after the reload: the reloaded model steps as the one that saved (the AdamW
    # moments came back; fresh ones would move every weight by about the learning rate), and
    # both as DDP; the gradients are summed over other groupings (2 + 2 against 4), hence 1e-6.
    assert launched["next_diff_loaded"] < 1e-6, launched["next_diff_loaded"]
    assert launched["next_diff_plain"] < 1e-6, launched["next_diff_plain"]
    hybrid, loaded, plain = launched["next_losses"]
    assert hybrid == loaded  # the loss of the reloaded weights, computed before the step
    assert abs(hybrid - plain) <= 1e-6 * abs(plain)


def test_hpz_gathers_backward_inside_each_node_and_trains_as_ddp(launched: dict[str, Any]) -> None:
    nodes: dict[int, list[int]] = {}
    for placement in launched["placements"]:
        nodes.setdefault(placement["agent_pid"], []).append(placement["rank"])
    # Every rank's secondary group is its node's ranks; the chunks are sharded over all 4.
    for placement, group in zip(
        launched["placements"], launched["hpz_secondary_groups"], strict=True
    ):
        assert sorted(group) == sorted(nodes[placement["agent_pid"]])
    assert launched["hpz_chunk_world"] == [4]
    assert launched["hpz_secondary_gathers"] > 0
    # Stage 3 over 4 ranks sums each gradient in another order than DDP's all-reduce.
    assert launched["hpz_diff"] < 1e-6, launched["hpz_diff"]
    assert launched["hpz_losses"][0] == launched["plain_losses"][0]
