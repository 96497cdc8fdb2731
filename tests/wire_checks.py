"""What the wire-format tests run on their ranks and check there (tests/test_wire_formats.py
for 2 ranks, tests/test_wire_formats_four_ranks.py for 4): each gather's compute buffer against
the shards, each reduced gradient against the round trips of the plain loop's, training runs
at stages 1-3, and the closeness of a run to the plain loop. The tolerances are argued in
tests/test_wire_formats.py's docstring.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from helpers import (
    CHUNK_NUMEL,
    batch_slice,
    make_model,
    round_trip_bound,
)

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.chunk import Chunk, ChunkState
from shardwise.comm import CommOp, CommStats
from shardwise.comm.quantize import BlockQuantizer

STEPS = 4
KINDS = ("int8", "fp8")
LOSS_RTOL = 1e-2
DRIFT_SHARE = 0.25
DRIFT_SHARE_INT4 = 0.5
LOSS_RTOL_INT4 = 2e-2
INT4_TOLERANCES = (DRIFT_SHARE_INT4, LOSS_RTOL_INT4)
BF16_FP32 = MixedPrecision(param_dtype=torch.bfloat16, compute_dtype=torch.float32)
FP16_FP32 = MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32)


def all_gather(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's `tensor`, exactly, as rows in rank order."""
    world = dist.get_world_size(group)
    rows = torch.empty(world * tensor.numel(), dtype=tensor.dtype)
    dist.all_gather_into_tensor(rows, tensor.reshape(-1).contiguous(), group=group)
    return rows.view(world, -1)


def gather_round(chunks: list[Chunk], stats: CommStats) -> dict[str, Any]:
    """Gather every chunk once more, as training does (stage 3 from its shards, stages 1-2
    refreshing their kept copy), and check what each rank's compute buffer holds against the
    shards, gathered exactly: this rank's own slice as its shard, the others' as the format's
    round trip of theirs (or as they are, unquantized). Also: the bytes of that round, and
    whether the masters stayed as they were."""
    before_bytes = stats.payload_bytes(CommOp.ALL_GATHER)
    checks = {"own_exact": True, "others_as_format": True, "others_moved": False}
    expected_bytes = 0
    masters_kept = True
    for chunk in chunks:
        masters_before = chunk.master.clone()
        if chunk.keep_gathered:
            chunk.payload.refresh_gathered()
        else:
            chunk.payload.gather()
        me = dist.get_rank(chunk.group)
        shards = all_gather(chunk.payload.shard, chunk.group)
        rows = chunk.payload.compute_buffer().view(chunk.world_size, -1)
        compute = rows.dtype
        quantizer: BlockQuantizer | None = getattr(chunk.wire.gather, "quantizer", None)
        for rank, shard in enumerate(shards):
            if rank == me:
                checks["own_exact"] &= torch.equal(rows[rank], shard.to(compute))
                continue
            sent = shard if quantizer is None else quantizer.round_trip(shard)
            checks["others_as_format"] &= torch.equal(rows[rank], sent.to(compute))
            checks["others_moved"] |= not torch.equal(rows[rank], shard.to(compute))
        if quantizer is None:
            expected_bytes += chunk.padded_numel * chunk.payload.shard.element_size()
        else:
            expected_bytes += chunk.world_size * quantizer.record_nbytes(chunk.shard_numel)
        masters_kept &= torch.equal(chunk.master, masters_before)
        if not chunk.keep_gathered:
            assert chunk.payload.state is ChunkState.GATHERED
            chunk.payload.release()
    checks["round_bytes_as_counted"] = (
        stats.payload_bytes(CommOp.ALL_GATHER) - before_bytes == expected_bytes
    )
    checks["masters_kept"] = masters_kept
    return checks


def reduced_grad_checks(
    chunks: list[Chunk], params: list[torch.Tensor], local_grads: list[list[torch.Tensor | None]]
) -> dict[str, Any]:
    """After a backward from the plain loop's weights, with quantized reductions (one chunk a
    reduction): each chunk's fp32 gradient shard against the plain loop's gradients
    (`local_grads[r]`: rank r's, per parameter of `params`, computed without the engine).
    It must be this rank's own slice plus the other ranks' round trips, over N, bit for bit;
    and within the format's bound of the plain loop's average: (1/N) sum over the other ranks
    of each value's round-trip bound, plus fp32's rounding of the sums."""
    me = dist.get_rank(chunks[0].group)
    world = chunks[0].world_size
    index = {id(p): i for i, p in enumerate(params)}
    exact, within, moved, worst = True, True, False, 0.0
    for chunk in chunks:
        quantizer: BlockQuantizer = getattr(chunk.wire.reduce, "quantizer")  # noqa: B009
        mine = slice(chunk.shard_begin, chunk.shard_begin + chunk.shard_numel)
        slices = []
        for grads in local_grads:  # each rank's gradient buffer, laid out as the chunk's
            flat = torch.zeros(chunk.padded_numel)
            for info in chunk.tensors:
                grad = grads[index[id(info.param)]]
                if grad is not None:
                    flat[info.offset : info.offset + info.numel] = grad.reshape(-1)
            slices.append(flat[mine])
        expected = slices[me].clone()
        bound = torch.zeros(chunk.shard_numel)
        for rank in range(world):
            if rank != me:
                expected += quantizer.round_trip(slices[rank])
                bound += round_trip_bound(quantizer.kind, slices[rank], quantizer.block_numel)
        got = chunk.grads.for_step()
        exact &= torch.equal(got, expected / world)
        mean = torch.stack(slices).sum(dim=0) / world
        slack = torch.stack(slices).abs().sum(dim=0) * 1e-6
        error = (got - mean).abs()
        within &= bool((error <= bound / world + slack).all())
        moved |= bool((error > 0).any())
        worst = max(worst, float((error / (bound / world + slack).clamp_min(1e-30)).max()))
    return {"exact": exact, "within_bound": within, "moved": moved, "worst_share": worst}


def plain_local_grads(step: int, world: int) -> list[list[torch.Tensor | None]]:
    """Each rank's gradients of step `step`'s batch from the plain loop's start, per
    parameter."""
    grads = []
    for rank in range(world):
        plain = make_model()
        plain(*batch_slice(step, 0, rank, world)).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in plain.parameters()])
    return grads


def train(
    stage: int,
    gather: str = "dtype",
    reduce: str = "dtype",
    precision: MixedPrecision | None = None,
    inf_loss_at: int | None = None,
) -> dict[str, Any]:
    """helpers.sharded's training (the GPT, AdamW, 2 ranks, the same batches) with the wire
    formats given; with `inf_loss_at`, rank 0's loss at that step is inf (an fp16 overflow on
    one rank). With quantized reductions alone, the first step's reduced gradients are checked
    against the plain loop's (`reduced_grad_checks`)."""
    rank = dist.get_rank()
    model = make_model()
    config: dict[str, Any] = {
        "device": torch.device("cpu"),
        "gather_format": gather,
        "reduce_format": reduce,
        "mixed_precision": precision or MixedPrecision(),
    }
    optim_config = None
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    else:
        optim_config = {"reduce_bucket_size": CHUNK_NUMEL}
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        optim_config=optim_config,
    )
    losses, skipped = [], []
    grad_checks = None
    chunks = list(wrapped.chunk_manager.trainable_chunks())
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, 2))
        if step == inf_loss_at and rank == 0:
            loss = loss * float("inf")
        optimizer.backward(loss)
        if step == 0 and reduce != "dtype" and gather == "dtype" and precision is None:
            params = list(model.parameters())
            grad_checks = reduced_grad_checks(chunks, params, plain_local_grads(0, 2))
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        optimizer.step()
        losses.append(float(total / 2))
        skipped.append(optimizer.last_step_skipped)
    stats = wrapped.comm_stats
    sent = {
        op.value: (stats.calls(op), stats.payload_bytes(op))
        for op in (CommOp.ALL_GATHER, CommOp.REDUCE_SCATTER, CommOp.ALL_REDUCE)
    }
    # Every trainable chunk is reduced once a step, on its own (no bucket at either stage).
    reduce_bytes = 0
    for chunk in chunks:
        quantizer = getattr(chunk.wire.reduce, "quantizer", None)
        if quantizer is None:
            reduce_bytes += chunk.padded_numel * chunk.dtypes.reduce.itemsize
        else:
            reduce_bytes += chunk.world_size * quantizer.record_nbytes(chunk.shard_numel)
    reduce_counted = stats.payload_bytes(CommOp.REDUCE_SCATTER) == STEPS * reduce_bytes
    totals = {op.value: (stats.sent_bytes(op), stats.unquantized_sent_bytes(op)) for op in CommOp}
    checks = gather_round(chunks, stats)
    return {
        "losses": losses,
        "skipped": skipped,
        "state": wrapped.state_dict(only_rank_0=False),
        "sent": sent,
        "totals": totals,
        "checks": checks,
        "grad_checks": grad_checks,
        "reduce_bytes_as_counted": reduce_counted,
    }


def reduce_wire_checks(kind: str = "int8", shard_numel: int = 50) -> dict[str, bool]:
    """A quantized reduce-scatter straight on its wire: the owner gets its own slice as it is
    plus the others' round trips in rank order, in fp32, within the sum of their bounds of the
    exact sum; the bytes counted are N records; an inf another rank holds in this rank's slice
    arrives as nan (so the owner's step finds the overflow), and nowhere else."""
    from shardwise.chunk.wire import QuantizedReduce

    me, world = dist.get_rank(), dist.get_world_size()
    quantizer = BlockQuantizer(kind, 16)  # blocks of 16, 16, 16 and the rest

    def buffer_of(rank: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(rank)
        # Magnitudes over four decades, so fp8's relative bound and int8's absolute one differ.
        magnitude = torch.logspace(-2, 2, world * shard_numel)
        values = torch.randn(world * shard_numel, generator=generator) * magnitude
        return values.to(torch.float16)

    stats = CommStats()
    wire = QuantizedReduce(quantizer, stats, None, None, torch.device("cpu"))
    work, reduced = wire.start_reduce_scatter(buffer_of(me), async_op=True)
    assert work is not None
    work.wait()
    mine = slice(me * shard_numel, (me + 1) * shard_numel)
    expected = buffer_of(me)[mine].float()
    for rank in range(world):
        if rank != me:
            expected += quantizer.round_trip(buffer_of(rank)[mine])
    record_nbytes = quantizer.record_nbytes(shard_numel)
    checks = {
        "sum_exact": torch.equal(reduced, expected),
        "fp32": reduced.dtype == torch.float32,
        "bytes_as_counted": stats.payload_bytes(CommOp.REDUCE_SCATTER) == world * record_nbytes
        and stats.sent_bytes(CommOp.REDUCE_SCATTER) == (world - 1) * record_nbytes,
    }
    # Against the exact sum (fp64): each other rank's contribution is off by at most its
    # format's bound, plus fp32's rounding of the N - 1 additions (relative 2^-24 each).
    exact = sum(buffer_of(rank)[mine].double() for rank in range(world))
    bound = sum(
        round_trip_bound(kind, buffer_of(rank)[mine].float(), 16)
        for rank in range(world)
        if rank != me
    )
    slack = (world - 1) * 2.0**-24 * sum(buffer_of(r)[mine].double().abs() for r in range(world))
    error = (reduced.double() - exact).abs()
    checks["within_bound"] = bool((error <= bound.double() + slack).all())
    # Not vacuous: the decoded contributions did move.
    checks["moved"] = not torch.equal(reduced.double(), exact)
    # Rank 0 overflows at element 20 of rank 1's slice (block 1 of that slice).
    overflowing = buffer_of(me)
    if me == 0:
        overflowing[shard_numel + 20] = float("inf")
    _, reduced = wire.start_reduce_scatter(overflowing, async_op=False)
    if me == 1:
        checks["owner_sees_nan"] = bool(reduced[16:32].isnan().all())
        checks["rest_finite"] = bool(
            reduced[:16].isfinite().all() and reduced[32:].isfinite().all()
        )
    else:
        checks["owner_sees_nan"] = checks["rest_finite"] = bool(reduced.isfinite().all())
    return checks


def mean_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    total = sum(float((a[k].float() - b[k].float()).abs().sum()) for k in a)
    return total / sum(a[k].numel() for k in a)


def assert_close(
    run: dict[str, Any],
    losses: list[float],
    state: Any,
    start: Any,
    drift_share: float = DRIFT_SHARE,
    loss_rtol: float = LOSS_RTOL,
) -> None:
    """Losses within `loss_rtol`, weights within `drift_share` of the distance travelled on
    average, and not equal (the format was in use)."""
    relative = max(abs(a - b) / b for a, b in zip(run["losses"], losses, strict=True))
    assert relative <= loss_rtol, relative
    drift = mean_abs_diff(run["state"], state)
    assert 0.0 < drift <= drift_share * mean_abs_diff(state, start), drift
