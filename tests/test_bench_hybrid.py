"""benchmarks/bench_hybrid.py measures what the analysis of hybrid sharding predicts: on 4 gloo
ranks, a tiny GPT at stages 3 and 2 sends exactly 2 (R - 1) / R of each rank's fp32 gradient
shard across the 2 shard groups per step, and nothing across groups under full sharding."""

from __future__ import annotations

import sys
from pathlib import Path

from shardwise.testing import GPTConfig, run_ranks

# The benchmarks are scripts, not a package: reach the module through its directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_hybrid

TINY = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_cross_group_bytes_match_the_analysis() -> None:
    results = run_ranks(
        bench_hybrid.measure,
        bench_hybrid.WORLD,
        2,  # timed steps per turn
        1,  # round
        model_config=TINY,
        batch_per_rank=1,
        seq_len=16,
        chunk_size_numel=4096,  # several chunks at stage 3
        timeout_s=120,
    )
    for per_rank in results:
        assert [s["name"] for s in per_rank] == [layout.name for layout in bench_hybrid.LAYOUTS]
        for summary in per_rank:
            assert len(summary["across"]) == 2
            assert summary["across"] == [summary["analysis"]] * 2, summary["name"]
            if summary["hybrid"]:
                assert summary["analysis"] > 0
            else:
                assert summary["across"] == [0, 0]
        # hpZ: backward's gathers moved into the 2-rank groups, the rest as full sharding.
        by_name = {summary["name"]: summary for summary in per_rank}
        full, hpz = by_name["stage 3, full"], by_name["stage 3, full, hpZ 2"]
        assert all(b > 0 for b in hpz["in_node"]) and full["in_node"] == [0, 0]
        assert max(hpz["within"]) < min(full["within"])
        assert hpz["loss"] == full["loss"]
