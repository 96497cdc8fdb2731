"""Trainer.fit with the shardwise strategies against Lightning's own `ddp`, on 2 CPU ranks.

Both run in the same forked ranks (see lightning_cases.py) on the same seed, data and global
batch. In fp32 the sharded runs are bit-identical to `ddp`, losses and final parameters: with 2
ranks each averaged gradient element is (a + b) / 2 in both, and the engine's optimizer applies
the same elementwise update to its shard. Gradient clipping differs in the last bits (the
global norm is summed over shards in another order than clip_grad_norm_ sums it), which Adam
can grow to ~1e-6 here: compared to 1e-5. 16-bit payloads round parameters to 8 (bf16) or 11
(fp16) bits each step, so those runs are compared with the fp32 `ddp` run to 5e-2 on the loss.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_cases import FitResult, Net, fit, trainer

from shardwise import Communication, DynamicGradScaler, EngineConfig, Overlap
from shardwise.testing import run_ranks
from shardwise_lightning import FullyShardedStrategy, GeminiStrategy, ShardwisePrecision

EXACT_CASES: dict[str, Any] = {
    "registered_gemini": lambda: "shardwise_gemini",
    "registered_fsdp": lambda: "shardwise_fsdp",
    "gemini_offload": lambda: "shardwise_gemini_offload",
    "gemini_small_chunks": lambda: GeminiStrategy(placement_policy="cuda", chunk_size=500),
    "gemini_no_chunk": lambda: GeminiStrategy(placement_policy="cuda", use_chunk=False),
    "gemini_unsharded_storage": lambda: GeminiStrategy(
        placement_policy="cuda", chunk_size=500, enable_distributed_storage=False
    ),
    "gemini_static": lambda: GeminiStrategy(
        placement_policy="static", chunk_size=500, offload_optim_frac=1.0, offload_param_frac=0.5
    ),
    "fsdp_small_units_buckets": lambda: FullyShardedStrategy(min_num_params=700, bucket_cap_mb=0),
    "fsdp_offload": lambda: FullyShardedStrategy(cpu_offload=True, min_num_params=700),
    # Hybrid sharding with shard groups of one rank: each rank holds a whole replica and the
    # gradients are all-reduced across the two groups, as DDP does.
    "gemini_hybrid": lambda: GeminiStrategy(placement_policy="cuda", chunk_size=500, shard_size=1),
    "fsdp_hybrid": lambda: FullyShardedStrategy(min_num_params=700, shard_size=1),
    # hpZ with secondary groups of one rank: each rank keeps its whole copy of every chunk
    # from forward to backward, which then gathers nothing over both ranks.
    "gemini_hpz": lambda: GeminiStrategy(
        placement_policy="cuda", chunk_size=500, secondary_shard_size=1
    ),
    # Chunks stepping during backward, inside Lightning's optimizer closure.
    "gemini_step_in_backward": lambda: GeminiStrategy(
        engine_config=EngineConfig(
            stage=3, device=torch.device("cpu"), overlap=Overlap(step_in_backward=True)
        ),
        placement_policy="cpu",
        chunk_size=500,
    ),
}


# Cases that add the same numbers in another order than ddp (see the module docstring).
ROUNDED = ("clip", "accumulate")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _fp32_cases() -> dict[str, tuple[FitResult, FitResult]]:
    """Per case: (ddp, shardwise) on this rank."""
    results: dict[str, tuple[FitResult, FitResult]] = {}
    reference = fit("ddp", max_epochs=2)
    for name, make in EXACT_CASES.items():
        results[name] = (reference, fit(make(), max_epochs=2))
    # Built in configure_model: sliced at creation, from rank 0's random state.
    late = partial(Net, build_late=True)
    results["configure_model"] = (
        fit("ddp", late),
        fit(GeminiStrategy(placement_policy="cuda", chunk_size=500), late),
    )
    # Compiled in configure_model, as Lightning's docs compile a model: the compiled module
    # is a gather unit at stage 3.
    compiled = partial(Net, compiled=True)
    results["compiled_gemini"] = (
        fit("ddp", compiled),
        fit(GeminiStrategy(placement_policy="cuda", chunk_size=500), compiled),
    )
    results["compiled_fsdp"] = (fit("ddp", compiled), fit("shardwise_fsdp", compiled))
    results["accumulate"] = (
        fit("ddp", accumulate_grad_batches=2, max_epochs=2),
        fit("shardwise_gemini", accumulate_grad_batches=2, max_epochs=2),
    )
    sgd = partial(Net, optimizer="sgd")
    results["sgd_momentum"] = (fit("ddp", sgd), fit("shardwise_fsdp", sgd))
    by_shape = partial(Net, optimizer="adamw_by_shape")
    results["groups_by_shape"] = (fit("ddp", by_shape), fit("shardwise_gemini", by_shape))
    results["clip"] = (
        fit("ddp", gradient_clip_val=0.05),
        fit(GeminiStrategy(placement_policy="cuda", chunk_size=500), gradient_clip_val=0.05),
    )
    return results


def test_fit_matches_ddp_fp32() -> None:
    per_rank = run_ranks(_fp32_cases, 2, timeout_s=120)
    for rank, results in enumerate(per_rank):
        for name, (ddp, ours) in results.items():
            assert len(ours.losses) == len(ddp.losses) > 0, (rank, name)
            # After fit the module's own state_dict() holds the whole trained weights too.
            own = _max_diff(ours.module_state, ddp.state)
            if name in ROUNDED:
                assert ours.losses == pytest.approx(ddp.losses, abs=1e-5), name
                assert _max_diff(ours.state, ddp.state) < 1e-5, name
                assert own < 1e-5, name
            else:
                assert ours.losses == ddp.losses, (rank, name)
                assert _max_diff(ours.state, ddp.state) == 0.0, (rank, name)
                assert own == 0.0, (rank, name)
    # hpZ's backward gathers came from the secondary copies (over one rank: no bytes sent).
    for results in per_rank:
        assert results["gemini_hpz"][1].comm["secondary_all_gather"]["calls"] > 0
        assert results["gemini_small_chunks"][1].comm["secondary_all_gather"]["calls"] == 0
    # The runs trained: later epochs' loss below the first steps'.
    losses = per_rank[0]["registered_gemini"][1].losses
    assert sum(losses[-4:]) < sum(losses[:4])
    # Accumulation halves the number of optimizer steps: its losses differ from plain runs'.
    assert per_rank[0]["accumulate"][1].losses != per_rank[0]["registered_gemini"][1].losses[:16]


def _sharded_layout() -> dict[str, Any]:
    """Where the model lives after fit: in chunks, each rank holding half of every chunk, and
    whole in the LightningModule (see [Note: the module after a run] in shardwise_lightning)."""
    strategy = GeminiStrategy(placement_policy="cuda", chunk_size=500)
    module = Net(build_late=True)
    run = trainer(strategy)
    run.fit(module)
    engine = strategy.zero_model
    assert engine is not None
    optimizer = strategy.zero_optimizer()
    assert optimizer is not None
    return {
        "stage": engine.stage,
        "visible_numel": sum(p.data.numel() for p in module.parameters()),
        "logical_numel": sum(p.numel() for p in module.parameters()),
        "model_numel": sum(v.numel() for v in strategy.lightning_module_state_dict().values()),
        "master_numel": sum(v.numel() for v in optimizer.shard_views.values()),
        "optimizer": type(optimizer.optim).__name__,
        "scheduler_steps": run.lr_scheduler_configs[0].scheduler.last_epoch,
        "lr": optimizer.param_groups[0]["lr"],
    }


def test_model_is_sharded_and_scheduler_drives_inner_optimizer() -> None:
    layouts = run_ranks(_sharded_layout, 2, timeout_s=60)
    total = layouts[0]["model_numel"]
    assert total == 16 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4
    for layout in layouts:
        assert layout["stage"] == 3
        assert layout["visible_numel"] == total  # the module holds its whole values again
        assert layout["logical_numel"] == total  # and reports the shape it was built with
        assert layout["optimizer"] == "AdamW"
        assert layout["scheduler_steps"] == 1  # one epoch, interval "epoch"
        assert layout["lr"] == pytest.approx(1e-2)  # StepLR(step_size=3) not yet decayed
    # Together the ranks' fp32 masters cover the model exactly once.
    assert sum(layout["master_numel"] for layout in layouts) == total


def _loops() -> dict[str, Any]:
    """Validation during fit, then test and predict, then a test of another module and of the
    first again on the same Trainer, for ddp and shardwise."""
    out: dict[str, Any] = {}
    for name, strategy in (("ddp", "ddp"), ("ours", "shardwise_fsdp")):
        torch.manual_seed(0)
        module = Net()
        run = trainer(strategy, max_epochs=2, limit_val_batches=3, val_check_interval=4)
        run.fit(module)
        val_metric = float(run.callback_metrics["val_loss"])
        tested = run.test(module, verbose=False)
        predicted = run.predict(module)
        assert predicted is not None
        torch.manual_seed(1)
        other = run.test(Net(), verbose=False)
        again = run.test(module, verbose=False)
        out[name] = {
            "other": other[0]["test_loss"],
            "again": again[0]["test_loss"],
            "val": module.val_losses,
            "val_metric": val_metric,
            "test": tested[0]["test_loss"],
            "predict": torch.cat([p for p in predicted if isinstance(p, torch.Tensor)]),
        }
    return out


def test_validation_test_and_predict_match_ddp() -> None:
    for result in run_ranks(_loops, 2, timeout_s=60):
        ddp, ours = result["ddp"], result["ours"]
        assert len(ours["val"]) == 2 * 2 * 3  # 2 checks per epoch, 3 batches each
        assert ours["val"] == ddp["val"]
        assert ours["val_metric"] == ddp["val_metric"]
        assert ours["test"] == ddp["test"]
        assert ours["other"] == ddp["other"] and ours["other"] != ours["test"]
        assert ours["again"] == ours["test"]
        assert ours["predict"].shape == (32, 4)
        assert torch.equal(ours["predict"], ddp["predict"])


def _mixed() -> dict[str, Any]:
    out: dict[str, Any] = {"ddp": fit("ddp")}
    for precision in ("bf16-mixed", "16-mixed"):
        strategy = GeminiStrategy(
            placement_policy="cuda",
            chunk_size=500,
            precision_plugin=ShardwisePrecision(precision),
            initial_scale=2**10,
        )
        result = fit(strategy)
        engine = strategy.zero_model
        optimizer = strategy.zero_optimizer()
        assert engine is not None and optimizer is not None
        chunk = engine.chunk_manager.chunks[0]
        out[precision] = (
            result,
            chunk.dtypes,
            isinstance(optimizer.grad_scaler, DynamicGradScaler),
            optimizer.loss_scale,
        )
    # Trainer(precision="bf16-mixed") reaches the engine through our plugin.
    strategy = GeminiStrategy(placement_policy="cuda")
    run = trainer(strategy, precision="bf16-mixed")
    out["trainer_flag"] = (
        type(run.strategy.precision_plugin).__name__,
        run.strategy.precision_plugin.precision,
    )
    return out


def test_mixed_precision_close_to_fp32_ddp() -> None:
    for result in run_ranks(_mixed, 2, timeout_s=60):
        ddp: FitResult = result["ddp"]
        for precision, payload in (("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)):
            ours, dtypes, dynamic, scale = result[precision]
            assert dtypes.payload == payload
            assert dtypes.compute == torch.float32  # fp32 math on CPU
            assert dynamic == (precision == "16-mixed")
            assert scale == (2**10 if precision == "16-mixed" else 1.0)
            assert ours.losses == pytest.approx(ddp.losses, abs=5e-2), precision
            assert ours.losses != ddp.losses  # 16-bit storage is really in play
            assert all(math.isfinite(v) for v in ours.losses)
        assert result["trainer_flag"] == ("ShardwisePrecision", "bf16-mixed")


def _quantized() -> dict[str, Any]:
    """Both strategies with int8 gathers and reductions, against `ddp`, 4 steps each; what
    the engine was configured with and which wire each chunk got."""
    out: dict[str, Any] = {"ddp": fit("ddp", max_steps=4)}
    strategies = {
        "gemini": GeminiStrategy(
            placement_policy="cuda",
            chunk_size=500,
            gather_format="int8",
            reduce_format="int8",
            quant_block_numel=64,
        ),
        "fsdp": FullyShardedStrategy(
            min_num_params=700, gather_format="int8", reduce_format="int8", quant_block_numel=64
        ),
    }
    for name, strategy in strategies.items():
        counted = _TrainingBytes()
        result = fit(strategy, max_steps=4, callbacks=[counted])
        engine = strategy.zero_model
        assert engine is not None
        chunks = engine.chunk_manager.chunks
        out[name] = {
            "fit": result,
            "communication": engine.config.communication,
            "wires": {(type(c.wire.gather).__name__, type(c.wire.reduce).__name__) for c in chunks},
            "comm": counted.snapshot,
        }
    return out


class _TrainingBytes(pl.Callback):
    """The engine's collective counters when training ends, before the strategy gathers the
    whole weights back into the module at teardown (exactly, not on the wire)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, dict[str, int]] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = trainer.strategy.zero_model  # type: ignore[attr-defined]
        self.snapshot = engine.comm_stats.snapshot()


def test_quantized_wire_formats_train_close_to_ddp() -> None:
    """int8 moves each value another rank sends by at most 1/254 of its block's largest
    magnitude: 4 steps stay within 1% of ddp's losses (tests/test_wire_formats.py states the
    bound), and differ from them (the formats were in use)."""
    for result in run_ranks(_quantized, 2, timeout_s=120):
        ddp: FitResult = result["ddp"]
        assert len(ddp.losses) == 4
        for name in ("gemini", "fsdp"):
            run = result[name]
            assert run["communication"] == Communication(
                gather="int8", reduce="int8", block_numel=64
            ), name
            assert run["wires"] == {("QuantizedGather", "QuantizedReduce")}, name
            ours: FitResult = run["fit"]
            assert ours.losses == pytest.approx(ddp.losses, rel=1e-2), name
            assert ours.losses != ddp.losses, name
            # Records of one byte a value and an fp32 scale per 64 against fp32's 4 bytes a
            # value (what the engine says the same collectives would have sent unquantized).
            for op in ("all_gather", "reduce_scatter"):
                count = run["comm"][op]
                ratio = count["sent_bytes"] / count["unquantized_sent_bytes"]
                assert ratio == pytest.approx((1 + 4 / 64) / 4, abs=0.01), (name, op, ratio)
