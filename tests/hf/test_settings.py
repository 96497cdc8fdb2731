"""Single-process checks of the callback's set-up: settings resolved from TrainingArguments,
every conflict in one error, and the transformers version gate."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shardwise import Communication, Placement
from shardwise_hf import ShardwiseCallback, check_transformers_version
from shardwise_hf.settings import CallbackOptions, resolve


def _args(**overrides: Any) -> SimpleNamespace:
    values: dict[str, Any] = {
        "fp16": False,
        "bf16": False,
        "device": torch.device("cpu"),
        "max_grad_norm": 1.0,
        "save_strategy": "steps",
        "eval_strategy": "no",
    }
    values.update(overrides)
    return SimpleNamespace(**values)


def test_auto_values_come_from_training_arguments() -> None:
    settings = resolve(CallbackOptions(), _args(bf16=True, max_grad_norm=0.5))
    assert settings.precision == "bf16"
    assert settings.mixed_precision.param_dtype == torch.bfloat16
    assert settings.mixed_precision.compute_dtype == torch.float32  # CPU computes in fp32
    assert settings.max_grad_norm == 0.5
    # "auto" placement without a budget on a CPU host keeps chunks where they compute.
    assert settings.config.placement.policy.name == "cuda"  # "device" is its alias
    budgeted = resolve(CallbackOptions(device_budget_bytes=2**20), _args())
    assert budgeted.config.placement.policy.name == "auto"
    assert budgeted.config.placement.device_budget_bytes == 2**20
    assert budgeted.precision == "fp32"


def test_explicit_fp16_on_fp32_arguments_is_honoured() -> None:
    settings = resolve(CallbackOptions(precision="fp16"), _args())
    assert settings.mixed_precision.uses_loss_scaling


def test_stage_two_takes_the_chunk_size_as_bucket() -> None:
    settings = resolve(CallbackOptions(zero_stage=2, chunk_size=1024), _args())
    assert settings.config.chunk_size_numel == 1024
    # zero_optim_wrapper's default: deferred on a GPU only (see `Overlap.param_gather`).
    assert not settings.config.defers_param_gather
    assert settings.config.placement == Placement()  # placement is stage 3's


def test_every_conflict_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as raised:
        resolve(
            CallbackOptions(zero_stage=4, placement_policy="cpu", precision="bf16"),
            _args(
                fp16=True,
                deepspeed="ds.json",
                fsdp="full_shard",
                fp16_full_eval=True,
            ),
        )
    message = str(raised.value)
    assert "5 problems" in message
    for expected in (
        "zero_stage must be 0, 1, 2 or 3, got 4",  # the engine's own refusal
        "precision='bf16' but TrainingArguments ask for fp16",
        "deepspeed",
        "fsdp='full_shard'",
        "fp16_full_eval=True",
    ):
        assert expected in message, expected


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_evaluation_and_the_best_checkpoint_are_accepted(stage: int) -> None:
    settings = resolve(
        CallbackOptions(zero_stage=stage),
        _args(eval_strategy="steps", save_strategy="best", load_best_model_at_end=True),
    )
    assert settings.zero_stage == stage


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_activation_checkpointing_is_accepted(stage: int) -> None:
    settings = resolve(
        CallbackOptions(zero_stage=stage),
        _args(
            activation_checkpointing=True,
            gradient_checkpointing=True,
            activation_checkpointing_kwargs={"use_reentrant": True},
        ),
    )
    assert settings.zero_stage == stage


def test_unsupported_transformers_is_refused() -> None:
    check_transformers_version("5.23.0")
    for version in ("4.57.1", "6.0.0"):
        with pytest.raises(RuntimeError, match=f"found {version}"):
            check_transformers_version(version)


def test_shard_size_reaches_the_engine_at_every_stage() -> None:
    for stage in (1, 2, 3):
        settings = resolve(CallbackOptions(zero_stage=stage, shard_size=2), _args())
        assert settings.config.topology.shard_size == 2
    assert resolve(CallbackOptions(), _args()).config.topology.shard_size is None


def test_secondary_shard_size_reaches_the_engine_at_stage_3_only() -> None:
    settings = resolve(CallbackOptions(zero_stage=3, secondary_shard_size=2), _args())
    assert settings.config.topology.secondary_shard_size == 2
    assert resolve(CallbackOptions(), _args()).config.topology.secondary_shard_size is None
    with pytest.raises(ValueError, match="applies to stage 3, where backward gathers"):
        resolve(CallbackOptions(zero_stage=2, secondary_shard_size=2), _args())


def test_wire_formats_reach_the_engine_at_every_stage() -> None:
    assert resolve(CallbackOptions(), _args()).config.communication == Communication()
    for stage in (1, 2, 3):
        callback = ShardwiseCallback(
            zero_stage=stage, gather_format="int8", reduce_format="fp8", quant_block_numel=128
        )
        settings = resolve(callback.options, _args())
        assert settings.config.communication == Communication(
            gather="int8", reduce="fp8", block_numel=128
        )


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        (
            {"gather_format": "bf16"},
            ValueError,
            r"^ShardwiseCallback: gather_format must be one of \('dtype', 'int8', 'fp8'\), "
            r"got 'bf16'$",
        ),
        ({"reduce_format": None}, TypeError, "reduce_format must be a str, .* got NoneType"),
        ({"quant_block_numel": 0}, ValueError, "quant_block_numel must be a positive int, got 0"),
        ({"quant_block_numel": "256"}, TypeError, "quant_block_numel must be a positive int"),
    ],
)
def test_bad_wire_formats_are_refused_when_the_callback_is_built(
    settings: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ShardwiseCallback(**settings)
