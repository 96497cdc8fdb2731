"""Arguments the engine cannot honour are refused when the strategy or Trainer is built, or at
setup before the first step: a clear ValueError/TypeError, never a traceback inside fit."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_cases import Net, trainer

from shardwise import Communication
from shardwise.testing import run_ranks
from shardwise_lightning import (
    STRATEGY_NAMES,
    FullyShardedStrategy,
    GeminiStrategy,
    ShardwisePrecision,
)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: GeminiStrategy(placement_policy="gpu"), ValueError, "'gpu'"),
        (
            lambda: GeminiStrategy(placement_policy="cuda", gpu_margin_mem_ratio=0.5),
            ValueError,
            "only to placement_policy='auto'",
        ),
        (
            lambda: GeminiStrategy(placement_policy="cuda", shard_param_frac=0.5),
            ValueError,
            "only to placement_policy='static'",
        ),
        (
            lambda: GeminiStrategy(placement_policy="cuda", use_chunk=False, chunk_size=64),
            ValueError,
            "use_chunk=False",
        ),
        (lambda: GeminiStrategy(placement_policy="cuda", chunk_size=0), ValueError, "chunk_size"),
        (
            lambda: GeminiStrategy(placement_policy="cpu", enable_distributed_storage=False),
            ValueError,
            "enable_distributed_storage=False",
        ),
        (lambda: GeminiStrategy(placement_policy="cuda", use_chunk=1), TypeError, "use_chunk"),
        (
            lambda: GeminiStrategy(placement_policy="cuda", growth_factor=0.5),
            ValueError,
            "growth_factor",
        ),
        (lambda: FullyShardedStrategy(flatten_parameters=False), ValueError, "flatten_parameters"),
        (
            lambda: FullyShardedStrategy(reshard_after_forward=False),
            ValueError,
            "reshard_after_forward",
        ),
        (lambda: FullyShardedStrategy(move_grads_to_cpu=True), ValueError, "move_grads_to_cpu"),
        (lambda: FullyShardedStrategy(compute_dtype=torch.int8), ValueError, "compute_dtype"),
        (lambda: FullyShardedStrategy(min_num_params=0), ValueError, "min_num_params"),
        (lambda: FullyShardedStrategy(hysteresis=0), ValueError, "hysteresis"),
        (lambda: ShardwisePrecision("16-true"), ValueError, "'16-true'"),
        (
            lambda: GeminiStrategy(placement_policy="cuda", state_dict_type="consolidated"),
            ValueError,
            "state_dict_type must be one of 'sharded', 'full', got 'consolidated'",
        ),
        (lambda: FullyShardedStrategy(state_dict_type="FULL"), ValueError, "got 'FULL'"),
        (
            lambda: GeminiStrategy(
                placement_policy="cuda", precision_plugin=pl.plugins.HalfPrecision()
            ),
            TypeError,
            "HalfPrecision",
        ),
        # The wire formats: each setting named with the value seen and the strategy.
        (
            lambda: GeminiStrategy(gather_format="int4"),
            ValueError,
            r"^GeminiStrategy: gather_format='int4' is not offered: int4 quantizes gradient "
            r"reductions only .* gather parameters in 'int8'",
        ),
        (
            lambda: GeminiStrategy(reduce_format="int16"),
            ValueError,
            r"^GeminiStrategy: reduce_format must be one of \('dtype', 'int8', 'fp8', 'int4'\), "
            r"got 'int16'$",
        ),
        (
            lambda: FullyShardedStrategy(reduce_format=8),
            TypeError,
            r"^FullyShardedStrategy: reduce_format must be a str, .* got int 8$",
        ),
        (
            lambda: FullyShardedStrategy(quant_block_numel=0),
            ValueError,
            "quant_block_numel must be a positive int, got 0",
        ),
        (
            lambda: GeminiStrategy(quant_block_numel=True),
            TypeError,
            "quant_block_numel must be a positive int .* got bool True",
        ),
    ],
)
def test_construction_refuses(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_auto_placement_without_cuda_keeps_chunks_on_the_compute_device() -> None:
    # The seed's default placement_policy="auto" has no budget off CUDA: every chunk stays on
    # the compute device, as GeminiPlugin does (see [Note: "auto" without a budget]). Decided
    # on the device the chunks live on, so a CUDA host with accelerator="cpu" does the same.
    cpu = torch.device("cpu")
    for strategy in (GeminiStrategy(), GeminiStrategy(placement_policy="auto")):
        placement = strategy.engine_config(cpu).placement
        assert (placement.policy.name, placement.device_budget_bytes) == ("cuda", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        registered = pl.Trainer(strategy="shardwise_gemini_auto", accelerator="cpu", devices=2)
    assert registered.strategy.engine_config(cpu).placement.policy.name == "cuda"  # type: ignore[attr-defined]
    # A budget given is honoured: "auto" then moves chunks under it.
    budgeted = GeminiStrategy(device_budget_bytes=2**20).engine_config(cpu).placement
    assert (budgeted.policy.name, budgeted.device_budget_bytes) == ("auto", 2**20)


def test_wire_formats_reach_the_engine_config() -> None:
    cpu = torch.device("cpu")
    assert GeminiStrategy().engine_config(cpu).communication == Communication()
    for strategy in (
        GeminiStrategy(gather_format="int8", reduce_format="fp8", quant_block_numel=64),
        FullyShardedStrategy(gather_format="int8", reduce_format="fp8", quant_block_numel=64),
    ):
        assert strategy.engine_config(cpu).communication == Communication(
            gather="int8", reduce="fp8", block_numel=64
        )


def test_registered_names_build_their_strategies() -> None:
    assert STRATEGY_NAMES == [
        "shardwise_fsdp",
        "shardwise_fsdp_offload",
        "shardwise_gemini",
        "shardwise_gemini_auto",
        "shardwise_gemini_offload",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offload = pl.Trainer(strategy="shardwise_fsdp_offload", accelerator="cpu", devices=2)
        gemini = pl.Trainer(strategy="shardwise_gemini", accelerator="cpu", devices=2)
        mixed = pl.Trainer(strategy="shardwise_fsdp", accelerator="cpu", precision="bf16-mixed")
    assert isinstance(offload.strategy, FullyShardedStrategy) and offload.strategy.cpu_offload
    assert isinstance(gemini.strategy, GeminiStrategy)
    assert gemini.strategy.engine_config(torch.device("cpu")).placement.policy.name == "cuda"
    assert isinstance(mixed.strategy.precision_plugin, ShardwisePrecision)
    assert mixed.strategy.precision_plugin.precision == "bf16-mixed"


def test_trainer_refuses_true_half_precision() -> None:
    with warnings.catch_warnings(), pytest.raises(TypeError, match="HalfPrecision"):
        warnings.simplefilter("ignore")
        pl.Trainer(strategy="shardwise_gemini", accelerator="cpu", precision="16-true")


class _TwoOptimizers(Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        raise AssertionError("setup must refuse before any step")

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.SGD(self.parameters(), lr=0.1),
            torch.optim.SGD(self.parameters(), lr=0.1),
        ]


class _Lbfgs(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters())


class _ClipOverride(Net):
    def configure_gradient_clipping(self, *args: Any, **kwargs: Any) -> None:
        pass


def _setup_errors() -> dict[str, str]:
    cases: dict[str, tuple[Net, dict[str, Any]]] = {
        "clip_by_value": (Net(), {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}),
        "two_optimizers": (_TwoOptimizers(), {}),
        "lbfgs": (_Lbfgs(), {}),
        "clip_override": (_ClipOverride(), {}),
    }
    messages: dict[str, str] = {}
    for name, (module, kwargs) in cases.items():
        try:
            trainer("shardwise_gemini", **kwargs).fit(module)
        except (ValueError, TypeError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
        assert module.losses == [], name  # refused before the first step
    return messages


def test_setup_refuses_before_the_first_step() -> None:
    messages = run_ranks(_setup_errors, 1, timeout_s=60)[0]
    assert "gradient_clip_algorithm='value'" in messages["clip_by_value"]
    assert "exactly one optimizer" in messages["two_optimizers"]
    assert "LBFGS" in messages["lbfgs"]
    assert "configure_gradient_clipping" in messages["clip_override"]
