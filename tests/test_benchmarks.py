"""The interleaved benchmark trains every engine alike: torch's and shardwise's engines, each on
its own copy of the model in one process group, reach bit-identical losses (2 ranks, fp32).

bench_ab and bench_convergence run here on 2 ranks forked from this process with torchrun's
environment (tests/forked_script.py): the same script, without torchrun's start-up (a fresh
interpreter importing torch per rank, several seconds each). bench_checkpoint stays under
torchrun: it measures each rank's peak resident set, which a rank forked from this large
process would inherit. How torchrun itself starts a script is tested by the examples' tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from forked_script import run_script
from launch import torchrun

ROOT = Path(__file__).resolve().parents[1]


def _on_two_ranks(script: str, *options: str, logs: Path) -> None:
    """benchmarks/`script` with `options` on 2 forked ranks, one thread each (as
    tests/launch.py's torchrun); every rank must exit 0."""
    outputs = run_script(
        ROOT / "benchmarks" / script, *options, out=logs, timeout_s=300,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    failed = [(rank, o.exit_code, o.stderr[-4000:]) for rank, o in enumerate(outputs)]
    assert all(code == 0 for _, code, _ in failed), failed


def test_interleaved_engines_reach_identical_losses(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    engines = "ddp,zero1,zero2,zero2+sync,fsdp2,zero3-cuda,zero3-cpu,zero2-rs"
    options = [
        "--engines", engines, "--out", str(out), "--rounds", "2", "--warmup", "1",
        "--n-layer", "2", "--n-embd", "64", "--vocab", "512", "--seq", "32", "--chunk-mib", "0.1",
    ]  # fmt: skip
    _on_two_ranks("bench_ab.py", *options, logs=tmp_path / "ranks")
    summary = json.loads(out.read_text())
    runs = summary["engines"]
    assert list(runs) == engines.split(",")
    # 1 warm-up step, then 2 rounds of 3-step turns, each timed after its first step as a
    # loop runs them: one figure (ms per step) per turn.
    assert summary["steps_per_engine"] == 7 and summary["timing"] == "loop"
    assert all(
        len(run["step_ms"]) == 2 and len(run["round_median_ms"]) == 2 for run in runs.values()
    )
    losses = {name: run["final_loss"] for name, run in runs.items()}
    assert len(set(losses.values())) == 1, losses


def test_outside_timing_counts_every_step_with_its_place(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    engines = "local,ddp,zero2,zero3-cuda+int8"
    options = [
        "--engines", engines, "--out", str(out), "--rounds", "2", "--warmup", "0",
        "--block", "2", "--timing", "outside",
        "--n-layer", "2", "--n-embd", "64", "--vocab", "512", "--seq", "32", "--chunk-mib", "0.1",
    ]  # fmt: skip
    _on_two_ranks("bench_ab.py", *options, logs=tmp_path / "ranks")
    summary = json.loads(out.read_text())
    runs = summary["engines"]
    assert summary["timing"] == "outside" and summary["steps_per_engine"] == 4
    for run in runs.values():
        assert len(run["step_ms"]) == 4
        assert [place[:2] for place in run["every_step"]] == [[0, 0], [0, 1], [1, 0], [1, 1]]
        assert all(0 <= tail <= total for _, _, total, tail in run["every_step"])
    # `local` trains each rank's copy on its own part of the batch: no loss to share; int8
    # communication rounds.
    assert runs["ddp"]["final_loss"] == runs["zero2"]["final_loss"]
    int8 = runs["zero3-cuda+int8"]["final_loss"]
    assert abs(int8 - runs["ddp"]["final_loss"]) < 0.01 * runs["ddp"]["final_loss"], int8
    views_script = str(ROOT / "benchmarks" / "ab_views.py")
    views = subprocess.run(
        [sys.executable, views_script, str(out), "--pairs", "zero2/ddp"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert views.returncode == 0, views.stderr
    rows = [line.split("|") for line in views.stdout.splitlines()[2:6]]
    assert all(row[1].strip() == "zero2/ddp" for row in rows)
    every = [float(cell) for cell in rows[0][3:5]]
    zero2 = [step[2] for step in runs["zero2"]["every_step"]]
    ddp = [step[2] for step in runs["ddp"]["every_step"]]
    assert every[1] == round(sum(zero2) / sum(ddp), 3)


def test_convergence_benchmark_trains_each_format_on_the_demo_text(tmp_path: Path) -> None:
    out = tmp_path / "conv.json"
    options = [
        "--formats", "dtype/dtype,int8/int8", "--steps", "4", "--eval-every", "2",
        "--eval-batches", "2", "--out", str(out),
    ]  # fmt: skip
    _on_two_ranks("bench_convergence.py", *options, logs=tmp_path / "ranks")
    summary = json.loads(out.read_text())
    runs = summary["runs"]
    assert list(runs) == ["dtype/dtype", "int8/int8"]
    for run in runs.values():
        assert [step for step, _ in run["eval_loss"]] == [2, 4]
        assert len(run["train_loss"]) == 4 and all(loss > 0 for loss in run["train_loss"])
    # fp16 payloads: int8 records and scales against 2 bytes a value, both ways (0.51 over
    # 1,000 steps); over 4 steps the exact broadcast at wrap weighs more.
    assert runs["dtype/dtype"]["sent_vs_first"] == 1.0
    assert 0.5 < runs["int8/int8"]["sent_vs_first"] < 0.7


def test_gpu_benchmark_runs_its_smoke_configuration(tmp_path: Path) -> None:
    """The GPU half of the suite on a tiny model, on whatever device there is (the CPU in
    CI): every engine trains, and "largest" stops at the first size that trains."""
    script = str(ROOT / "benchmarks" / "bench_gpu.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    compare = tmp_path / "compare.json"
    command = [sys.executable, script, "compare", "--smoke", "--out", str(compare)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    engines = json.loads(compare.read_text())["engines"]
    assert set(engines) == {"torch", "fsdp2", "shardwise-cuda"}
    assert all(run["median_ms"] > 0 and run["tflops"] > 0 for run in engines.values())
    largest = tmp_path / "largest.json"
    command = [
        sys.executable, script, "largest", "--smoke", "--placement", "auto", "--out", str(largest)
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    attempts = json.loads(largest.read_text())["attempts"]
    assert [a["trained"] for a in attempts] == [True] and attempts[0]["n_layer"] == 2
    # Built on the meta device, beside the planner's bytes for it (under the smoke's budget).
    planned = attempts[0]["planner"]
    assert planned["fits"] and planned["device_state_gib"] + planned["host_gib"] > 0, planned


def test_gpu_session_parts_run_their_smoke_configuration(tmp_path: Path) -> None:
    """The bigger-than-the-GPU session's parts on tiny models, on whatever device there is (the
    CPU in CI): the bounds, Llama attempts under shardwise "auto" (built on the meta device,
    checkpointing on), FSDP2 with CPUOffloadPolicy and plain torch, each in a process of its
    own, one of them stopped at its timeout, and the results block."""
    # The session's script parses (`bash benchmarks/gpu_session.sh all OUT --smoke` runs every
    # part this way, and tests/gpu, in about 80 s here).
    session = ROOT / "benchmarks" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(session)], timeout=30).returncode == 0
    script = str(ROOT / "benchmarks" / "bench_gpu.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def bench(*options: str) -> str:
        done = subprocess.run(
            [sys.executable, script, *options], capture_output=True, text=True, timeout=240,
            env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    bench("bounds", "--smoke", "--out", str(tmp_path / "bounds.json"))
    bounds = json.loads((tmp_path / "bounds.json").read_text())
    assert "skipped" in bounds["copies"] or bounds["copies"]["sizes"][0]["pinned_h2d_gbps"] > 0
    assert bounds["adam"]["hybrid_adam"]["params_per_s"] > 0
    assert bounds["adam"]["adamw_fused"]["params_per_s"] > 0
    assert bounds["host_copy"]["copy_gbps"] > 0
    engines = "shardwise-auto,fsdp2-offload,torch"
    options = ["--engines", engines, "--timeouts", "200,200,1", "--steps", "1"]
    bench("llama", "--smoke", "--checkpointing", *options, "--out", str(tmp_path / "ll.json"))
    run = json.loads((tmp_path / "ll.json").read_text())
    attempts = run["attempts"]
    for engine in ("shardwise-auto", "fsdp2-offload"):
        assert attempts[engine]["outcome"] == "ok" and attempts[engine]["finished"], engine
        assert len(attempts[engine]["step_ms"]) == 2 and attempts[engine]["later_median_ms"] > 0
        assert attempts[engine]["host_hwm_gib"] > 0
    # The planner's figures for the placement, beside the measured ones.
    assert attempts["shardwise-auto"]["planner"]["fits"], attempts["shardwise-auto"]["planner"]
    assert attempts["torch"]["outcome"] == "past the 1 s limit"
    assert set(run["ratios"]) == {"shardwise-auto", "fsdp2-offload"}
    block = bench("report", str(tmp_path), "--command", "the command")
    assert (tmp_path / "RESULTS-gpu.md").read_text() == block[:-1]
    assert "    the command" in block and "**Targets**" in block
    assert (
        sum(line.startswith("| shardwise-auto | ok (finished)") for line in block.split("\n")) == 1
    )


def test_auto_placement_benchmark_writes_its_sweep(tmp_path: Path) -> None:
    # benchmarks/bench_auto.py, as the suite runs it, in its smallest configuration.
    results = tmp_path / "RESULTS.md"
    results.write_text("# kept\n")
    options = ["--rounds", "1", "--copies", "2", "--blocks", "2", "--results", str(results)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = ROOT / "benchmarks" / "bench_auto.py"
    result = subprocess.run(
        [sys.executable, str(script), *options], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    text = results.read_text()
    assert text.startswith("# kept\n")
    block = text[
        text.index("<!-- auto-placement:begin -->") : text.index("<!-- auto-placement:end -->")
    ]
    rows = [line for line in block.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 8, block  # the sweep's budgets
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1] != "fails", row  # auto trains at every budget of the sweep
        ratio, floor = float(cells[7]), float(cells[8])  # timed: both positive
        assert ratio > 0 and floor > 0, row


@pytest.mark.timeout(600)  # a launch past its 120 s is tried once more (see bench_memory)
def test_memory_benchmark_measures_each_engine_in_its_own_run(tmp_path: Path) -> None:
    """bench_memory.py on a tiny GPT: each engine under torchrun of its own, its phases read
    from both ranks' resident sets, and the results block written."""
    out, results = tmp_path / "memory.json", tmp_path / "RESULTS.md"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_memory.py"), "compare", "--smoke",
        "--engines", "ddp,zero3-cuda", "--steps", "2", "--out", str(out), "--results",
        str(results), "--attempt-timeout", "120",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=540, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    ddp, zero3 = json.loads(out.read_text())["runs"]
    assert (ddp["engine"], zero3["engine"]) == ("ddp", "zero3-cuda")
    assert ddp["params"] == zero3["params"] > 0
    # ZeRO's model state: 16 bytes a parameter under DDP, 16 / N at stage 3 (N = 2).
    assert ddp["model_state_bytes"] == 16 * ddp["params"] == 2 * zero3["model_state_bytes"]
    for run in (ddp, zero3):
        assert [rank["rank"] for rank in run["ranks"]] == [0, 1]
        for rank in run["ranks"]:
            assert rank["unit_bytes"] > 0 and rank["phases"]["peak"] > 0, rank
    table = results.read_text()
    assert "<!-- bench_memory: begin -->" in table and "| smoke | zero3-cuda |" in table


def test_checkpoint_benchmark_measures_every_call(tmp_path: Path) -> None:
    out, results = tmp_path / "ckpt.json", tmp_path / "RESULTS.md"
    options = ["--size", "smoke", "--out", str(out), "--results", str(results)]
    done = torchrun(ROOT / "benchmarks" / "bench_checkpoint.py", *options, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    calls = json.loads(out.read_text())["calls"]
    assert list(calls) == [
        "sharded save", "one file save", "sharded load", "engine save", "engine load",
        "fsdp2 dcp save", "fsdp2 dcp load",
    ]  # fmt: skip
    assert all(call["seconds"] > 0 and call["peak_mib"] >= 0 for call in calls.values())
    # The two layouts hold the same tensors (the sharded one adds an index and a config).
    assert (
        abs(calls["sharded save"]["bytes"] - calls["one file save"]["bytes"])
        < 0.1 * (calls["one file save"]["bytes"])
    )
    # The engine's own checkpoint holds the same state as torch.distributed.checkpoint's of
    # FSDP2 (model and Adam's state: the same format, other names and metadata).
    assert (
        abs(calls["engine save"]["bytes"] - calls["fsdp2 dcp save"]["bytes"])
        < 0.1 * calls["fsdp2 dcp save"]["bytes"]
    )
    assert "Checkpoints at scale" in results.read_text()


def test_lifecycle_benchmark_writes_what_each_engine_left(tmp_path: Path) -> None:
    # benchmarks/bench_lifecycle.py at its smallest: every engine frees its model each round.
    results = tmp_path / "RESULTS.md"
    options = ["--size", "smoke", "--rounds", "2", "--engines", "ddp,zero2,zero3-cuda"]
    _on_two_ranks("bench_lifecycle.py", *options, "--results", str(results), logs=tmp_path)
    rows = [line for line in results.read_text().splitlines() if line.startswith("| zero")]
    assert len(rows) == 2 and all(row.split("|")[2].strip() == "0 / 0" for row in rows), rows
