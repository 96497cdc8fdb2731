"""Hybrid sharding (2 shard groups of 2 ranks) and hpZ against full sharding over 4 ranks.

    python benchmarks/bench_hybrid.py [--steps 3] [--rounds 10]

Four forked gloo ranks on the CPU, one thread each, train the GPT of shardwise.testing (fp32,
AdamW fused) in five configurations: stage 3 and stage 2, each with `shard_size=2` (hybrid)
and without it (sharded over all 4 ranks), and stage 3 sharded over all 4 with hpZ's
secondary shards over 2 (`secondary_shard_size=2`). Every configuration trains its own copy of the
model (same seed, same batches) in the one process group; they take turns of one untimed step
then `--steps` timed ones, `--rounds` times, the order rotating each round, so drift in the
machine's speed hits them alike. Stage 3 uses a fixed chunk size (CHUNK_SIZE_NUMEL) in both
layouts, so they gather and reduce the same chunks; everything else is the engine's default.

Reported per configuration: rank 0's median step time and, per step and rank, the bytes sent
within shard groups (all-gather, reduce-scatter, all-reduce) and across them (the replicate
all-reduce), from `comm_stats` deltas around each timed step; and the cross-group bytes the
analysis predicts (see [Note: hybrid sharding] in shardwise/comm/topology.py). Writes its block
of benchmarks/RESULTS.md (between the hybrid-sharding markers).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.comm import CommOp, CommStats
from shardwise.engine.model import ZeroModel
from shardwise.engine.optimizer import ZeroOptimizer
from shardwise.testing import GPT, GPTConfig, gpt_batch, run_ranks

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BEGIN, END = "<!-- hybrid-sharding:begin -->", "<!-- hybrid-sharding:end -->"
WORLD = 4
SHARD_SIZE = 2
# ~1.06M parameters: a stage-3 step takes about 0.2 s and a stage-2 step about 0.1 s with 4
# ranks sharing 2 cores, so the default run stays well under two minutes.
MODEL = GPTConfig(vocab_size=2048, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH_PER_RANK = 2
SEQ_LEN = 64
# 2**17 elements (512 KiB fp32): the model spans 10 chunks, so stage 3 gathers and reduces
# chunk by chunk as it would at scale, and both layouts pack exactly the same chunks.
CHUNK_SIZE_NUMEL = 2**17
# Kinds counted as within shard groups (the whole group without hybrid sharding): the pass's
# gathers and reductions; the all-reduce kind is the step's agreement traffic, which runs
# over every rank but is under a kilobyte (reported in a column of its own).
WITHIN = (CommOp.ALL_GATHER, CommOp.REDUCE_SCATTER, CommOp.ALL_REDUCE)
ACROSS = CommOp.REPLICATE_ALL_REDUCE
# hpZ's gathers from secondary shards, inside groups of SHARD_SIZE ranks (a node's links).
IN_NODE = CommOp.SECONDARY_ALL_GATHER


@dataclass(frozen=True)
class Layout:
    """One configuration: a ZeRO stage and a shard size (None: shard over every rank)."""

    stage: int
    shard_size: int | None
    # ZeRO++ hpZ: backward's gathers inside groups of this many ranks (see [Note: secondary
    # shards] in shardwise/chunk/chunk.py).
    secondary_shard_size: int | None = None

    @property
    def name(self) -> str:
        groups = (
            f"hybrid {WORLD // self.shard_size}x{self.shard_size}" if self.shard_size else "full"
        )
        if self.secondary_shard_size:
            groups += f", hpZ {self.secondary_shard_size}"
        return f"stage {self.stage}, {groups}"


LAYOUTS = (
    Layout(3, None),
    Layout(3, SHARD_SIZE),
    Layout(3, None, SHARD_SIZE),
    Layout(2, None),
    Layout(2, SHARD_SIZE),
)


@dataclass
class Run:
    """One configuration's model, optimizer and what its timed steps measured on this rank."""

    layout: Layout
    model: ZeroModel
    optimizer: ZeroOptimizer
    steps_ms: list[float] = field(default_factory=list)
    # Per timed step: bytes this rank sent, by CommOp value.
    sent: list[dict[str, int]] = field(default_factory=list)
    loss: float = float("nan")


def build(layout: Layout, model_config: GPTConfig, chunk_size_numel: int) -> Run:
    """Wrap a freshly seeded GPT for `layout`; every layout starts from the same weights."""
    torch.manual_seed(0)
    model = GPT(model_config)
    config: dict[str, Any] = {"device": torch.device("cpu")}
    if layout.shard_size is not None:
        config["shard_size"] = layout.shard_size
    if layout.secondary_shard_size is not None:
        config["secondary_shard_size"] = layout.secondary_shard_size
    if layout.stage == 3:
        config["chunk_size_numel"] = chunk_size_numel
    wrapped = zero_model_wrapper(model, layout.stage, config)
    optimizer = zero_optim_wrapper(
        wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    )
    return Run(layout, wrapped, optimizer)


def local_batch(
    model_config: GPTConfig, batch_per_rank: int, seq_len: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step `step`'s global batch (the same global batch in every run)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    idx, targets = gpt_batch(model_config, batch_per_rank * world, seq_len, step)
    rows = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)
    return idx[rows], targets[rows]


def sent_by_kind(stats: CommStats) -> dict[str, int]:
    """Bytes this rank has sent so far, per op kind."""
    return {kind: count["sent_bytes"] for kind, count in stats.snapshot().items()}


def train_step(run: Run, batch: tuple[torch.Tensor, torch.Tensor], timed: bool) -> None:
    """One optimizer step; when `timed`, record its wall time and the bytes it sent."""
    before = sent_by_kind(run.model.comm_stats)
    start = time.perf_counter()
    run.optimizer.zero_grad()
    _, loss = run.model(*batch)
    run.optimizer.backward(loss)
    run.optimizer.step()
    elapsed = time.perf_counter() - start
    run.loss = float(loss.item())
    if timed:
        after = sent_by_kind(run.model.comm_stats)
        run.steps_ms.append(1000 * elapsed)
        run.sent.append({kind: after[kind] - before[kind] for kind in after})


def analysed_cross_bytes(run: Run) -> Fraction:
    """Cross-group bytes one rank sends per step by the analysis: with R shard groups, a ring
    all-reduce of its fp32 gradient shard sends 2 (R - 1) / R of the shard's bytes."""
    shard_size = run.layout.shard_size or WORLD
    replicas = WORLD // shard_size
    shard_bytes = sum(c.shard_numel * 4 for c in run.model.chunk_manager.trainable_chunks())
    return Fraction(2 * (replicas - 1), replicas) * shard_bytes


def summarise(run: Run) -> dict[str, Any]:
    """What this rank reports for one configuration: step times, the per-step bytes of every
    timed step (so constancy across steps can be checked), the analysis, the last loss."""
    return {
        "name": run.layout.name,
        "stage": run.layout.stage,
        "hybrid": run.layout.shard_size is not None,
        "steps_ms": run.steps_ms,
        "within": [sum(s[k.value] for k in WITHIN) for s in run.sent],
        "all_reduce": [s[CommOp.ALL_REDUCE.value] for s in run.sent],
        "across": [s[ACROSS.value] for s in run.sent],
        "in_node": [s[IN_NODE.value] for s in run.sent],
        "total": [sum(s[k.value] for k in (*WITHIN, ACROSS, IN_NODE)) for s in run.sent],
        "analysis": analysed_cross_bytes(run),
        "chunks": sum(1 for _ in run.model.chunk_manager.trainable_chunks()),
        "loss": run.loss,
    }


def measure(
    steps: int,
    rounds: int,
    model_config: GPTConfig = MODEL,
    batch_per_rank: int = BATCH_PER_RANK,
    seq_len: int = SEQ_LEN,
    chunk_size_numel: int = CHUNK_SIZE_NUMEL,
) -> list[dict[str, Any]]:
    """Per rank (run through run_ranks on WORLD ranks): build every layout once, then train
    them in interleaved turns and return each layout's summary, in LAYOUTS order."""
    torch.set_num_threads(1)
    runs = [build(layout, model_config, chunk_size_numel) for layout in LAYOUTS]
    step = 0
    for round_index in range(rounds):
        # Rotate the order so no configuration always follows the same one.
        shift = round_index % len(runs)
        for run in runs[shift:] + runs[:shift]:
            dist.barrier()  # start each turn together; not counted in comm_stats or the time
            # The first step of a turn refills the caches the previous configuration used.
            for turn_step in range(steps + 1):
                batch = local_batch(model_config, batch_per_rank, seq_len, step + turn_step)
                train_step(run, batch, timed=turn_step > 0)
        step += steps + 1
    return [summarise(run) for run in runs]


def table(results: list[list[dict[str, Any]]]) -> list[str]:
    """Markdown rows from every rank's summaries: rank 0's times, bytes per step and rank."""
    rows = [
        "| configuration | median ms/step | vs full | within groups B/step | of which all-reduce"
        " | across groups B/step | hpZ in node B/step | total B/step | analysis"
        " | measured - analysis | final loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    full_ms: dict[int, float] = {}  # LAYOUTS lists each stage's full sharding first
    for index, summary in enumerate(results[0]):
        per_rank = [rank_results[index] for rank_results in results]
        ms = statistics.median(summary["steps_ms"])
        full_ms.setdefault(summary["stage"], ms)
        across = seen(per_rank, "across")
        rows.append(
            f"| {summary['name']} | {ms:.1f} | {ms / full_ms[summary['stage']]:.2f}"
            f" | {_bytes(seen(per_rank, 'within'))} | {_bytes(seen(per_rank, 'all_reduce'))}"
            f" | {_bytes(across)} | {_bytes(seen(per_rank, 'in_node'))}"
            f" | {_bytes(seen(per_rank, 'total'))}"
            f" | {_number(summary['analysis'])}"
            f" | {_difference(across, summary['analysis'])} | {summary['loss']:.6f} |"
        )
    return rows


def seen(per_rank: list[dict[str, Any]], key: str) -> set[int]:
    """Every per-step byte count of `key` over the timed steps of every rank: one value when
    each step sends the same, as the analysis assumes."""
    return {value for summary in per_rank for value in summary[key]}


def _bytes(values: set[int]) -> str:
    if len(values) == 1:
        return f"{next(iter(values)):,}"
    return f"{min(values):,} to {max(values):,}"


def _number(value: Fraction) -> str:
    return f"{int(value):,}" if value.denominator == 1 else f"{float(value):,.1f}"


def _difference(measured: set[int], analysis: Fraction) -> str:
    if len(measured) != 1:
        return "varies"
    return _number(next(iter(measured)) - analysis)


def write_block(lines: list[str]) -> None:
    """Replace the hybrid-sharding block of RESULTS.md, or append it when there is none."""
    block = "\n".join([BEGIN, *lines, END]) + "\n"
    text = RESULTS.read_text() if RESULTS.exists() else ""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text + "\n" + block
    RESULTS.write_text(text)


def report(results: list[list[dict[str, Any]]], steps: int, rounds: int) -> list[str]:
    """The block's text: heading, command, what was measured, the table, how to read it."""
    chunks = {s["name"]: s["chunks"] for s in results[0]}
    agreement = max(b for rank in results for s in rank for b in s["all_reduce"])
    return [
        "## Hybrid sharding (2 groups of 2) and hpZ against full sharding over 4 ranks",
        "",
        f"`python benchmarks/bench_hybrid.py --steps {steps} --rounds {rounds}` (CPU, gloo, 4"
        f" forked ranks of one thread on 2 cores, torch {torch.__version__}; GPT with"
        f" {GPT(MODEL).num_parameters():,} parameters: n_layer {MODEL.n_layer}, n_embd"
        f" {MODEL.n_embd}, vocab {MODEL.vocab_size}, seq {SEQ_LEN}, {BATCH_PER_RANK} sequences"
        " per rank; fp32, AdamW fused). Stage 3 with chunk_size_numel"
        f" {CHUNK_SIZE_NUMEL:,} in every layout ({chunks['stage 3, full']} trainable chunks);"
        f" stage 2 with the default bucket size ({chunks['stage 2, full']} chunk). The five"
        f" configurations take turns of 1 untimed + {steps} timed steps, {rounds} rounds,"
        " the order rotating, each training its own copy of the model in one process group.",
        "",
        "Times: rank 0's median over the timed steps; vs full: that over the same stage's full"
        " sharding. Bytes: sent by one rank in one step (`comm_stats` deltas around the step),"
        " the same on every rank and every timed step unless a range is shown. Within groups:"
        " all-gather + reduce-scatter + all-reduce kinds; across groups: `replicate_all_reduce`."
        " Analysis: 2 (R - 1) / R x the rank's fp32 gradient shard (the sum of `shard_numel * 4`"
        " over trainable chunks), R = 2 groups; zero with one group. hpZ in node:"
        " `secondary_all_gather`, backward's gathers from the secondary shards kept over 2"
        ' ranks (one "node"); its other collectives run over all 4 ranks, as full sharding\'s.',
        "",
        *table(results),
        "",
        "The all-reduce column is the step's agreement traffic (gradient norm, step and pass"
        " signatures, which tensors got gradients); it runs over all 4 ranks, so strictly it"
        f" crosses groups too, at most {agreement:,} bytes per step here. This is a CPU/gloo"
        " loopback measurement on 2 cores: the links between groups are no slower than those"
        " within one, so the time ratio says nothing about multi-node speed. The bytes are what"
        " matters: hybrid sharding keeps the gathers and reductions inside a group and sends"
        " only each rank's gradient shard across. At stage 2 a rank sends as many bytes in"
        " total either way (2 (N - 1) / N of the model's fp32 bytes, N = 4): hybrid changes"
        " where they travel, not how many there are; at stage 3, whose gathers outnumber its"
        " reductions, the total falls too. hpZ keeps full sharding's memory and gradient"
        " traffic and moves backward's gathers inside the node, where each sends half a chunk"
        " instead of three quarters over all 4 ranks; it pays with half of each chunk held on"
        " every rank from forward to backward (its loss is full sharding's, bit for bit).",
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    results = run_ranks(measure, WORLD, args.steps, args.rounds, timeout_s=600)
    lines = report(results, args.steps, args.rounds)
    print("\n".join(lines))
    write_block(lines)


if __name__ == "__main__":
    main()
