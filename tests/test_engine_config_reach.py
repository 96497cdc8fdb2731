"""Every setting of the engine is reachable from each adapter (Lightning's two strategies, the
Trainer callback) through its typed `engine_config=`: for each field of `EngineConfig` and of
its parts, walked so that a field added later is checked too, an engine_config giving it a
value other than its default builds the configuration the adapter runs with that value and
every other setting as given. The adapters' own arguments refine it (see [Note: engine_config
and the arguments that refine it] in shardwise/engine/refine.py), and what cannot be honoured
is refused with the value seen and the fix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn

from shardwise import Chunking, EngineConfig, MixedPrecision, Placement, Reduction
from shardwise.gemini import HostPlacement, StaticPlacement
from shardwise_hf import ShardwiseCallback
from shardwise_hf.settings import resolve
from shardwise_lightning import FullyShardedStrategy, GeminiStrategy, ShardwisePrecision

CPU = torch.device("cpu")
_LIGHTNING_PRECISIONS = {
    torch.float32: "32-true",
    torch.float16: "16-mixed",
    torch.bfloat16: "bf16-mixed",
}


def _init_nothing(module: nn.Module) -> None:
    pass


# A value other than the default for every setting, valid at stage 3 on a CPU by itself.
VALUES: dict[str, Any] = {
    "stage": 2,
    "device": CPU,  # the framework's; see test_the_device_is_the_frameworks
    "precision.param_dtype": torch.bfloat16,
    "precision.compute_dtype": torch.bfloat16,
    "precision.reduce_dtype": torch.bfloat16,
    "chunking.size_numel": 4096,
    "chunking.search_range_bytes": 2**20,
    "chunking.search_n_grids": 7,
    "chunking.min_chunk_bytes": 2**10,
    "chunking.hidden_dim": 64,
    "placement.policy": HostPlacement(),
    "placement.device_budget_bytes": 2**30,
    "placement.pin_memory": True,
    "placement.disk_fraction": 0.5,
    "placement.disk_dir": "/tmp/shardwise-disk",
    "placement.host_budget_bytes": 2**30,
    "placement.host_buffer_pool": True,
    "reduction.method": "all_reduce",
    "reduction.bucket_bytes": 1024,
    "reduction.predivide_factor": 2.0,
    "overlap.communication": False,
    "overlap.param_gather": False,
    "overlap.prefetch": False,
    "overlap.prefetch_chunks": 3,
    "overlap.step_in_backward": True,
    "topology.process_group": cast(Any, object()),  # never used: no model is wrapped
    "topology.shard_size": 2,
    "topology.secondary_shard_size": 2,
    "communication.gather": "int8",
    "communication.reduce": "int8",
    "communication.block_numel": 128,
    "gather_units": (nn.Linear,),
    "force_outputs_fp32": True,
    "param_init_fn": _init_nothing,
}


def _settings() -> list[str]:
    """Every field of EngineConfig, a part's fields by "part.field"."""
    found = []
    base = EngineConfig(stage=3, device=CPU)
    for field in fields(EngineConfig):
        value = getattr(base, field.name)
        if is_dataclass(value):
            found.extend(f"{field.name}.{inner.name}" for inner in fields(value))
        else:
            found.append(field.name)
    return found


def _with(setting: str, value: Any) -> EngineConfig:
    """A stage-3 EngineConfig on the CPU with `setting` set to `value`."""
    config = EngineConfig(stage=3, device=CPU)
    part, _, name = setting.partition(".")
    if not name:
        return replace(config, **{part: value})
    return replace(config, **{part: replace(getattr(config, part), **{name: value})})


def _lightning(cls: type) -> Callable[..., EngineConfig]:
    def build(engine_config: EngineConfig, **arguments: Any) -> EngineConfig:
        strategy = cls(engine_config=engine_config, **arguments)
        dtype = engine_config.precision.param_dtype
        strategy.precision_plugin = ShardwisePrecision(_LIGHTNING_PRECISIONS[dtype])
        return cast(EngineConfig, strategy.engine_config(CPU))

    return build


def _args(dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    return SimpleNamespace(
        fp16=dtype == torch.float16,
        bf16=dtype == torch.bfloat16,
        device=CPU,
        max_grad_norm=1.0,
        save_strategy="steps",
        eval_strategy="no",
    )


def _callback(engine_config: EngineConfig, **arguments: Any) -> EngineConfig:
    callback = ShardwiseCallback(engine_config=engine_config, **arguments)
    return resolve(callback.options, _args(engine_config.precision.param_dtype)).config


ENTRY_POINTS: dict[str, Callable[..., EngineConfig]] = {
    "GeminiStrategy": _lightning(GeminiStrategy),
    "FullyShardedStrategy": _lightning(FullyShardedStrategy),
    "ShardwiseCallback": _callback,
}


def test_every_setting_has_a_value_here() -> None:
    missing = sorted(set(_settings()) - set(VALUES))
    assert not missing, f"give these new EngineConfig settings a value in VALUES: {missing}"


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("setting", [s for s in _settings() if s not in ("stage", "device")])
def test_every_setting_reaches_the_engine(entry: str, setting: str) -> None:
    given = _with(setting, VALUES[setting])
    built = ENTRY_POINTS[entry](given)
    part, _, name = setting.partition(".")
    reached = getattr(getattr(built, part), name) if name else getattr(built, part)
    assert reached == VALUES[setting]
    # Nothing else changed: the precision is resolved on the device (its compute dtype),
    # every other setting is engine_config's.
    assert replace(built, precision=given.precision) == given


@pytest.mark.parametrize("entry", ["GeminiStrategy", "FullyShardedStrategy"])
def test_the_strategies_refuse_another_stage(entry: str) -> None:
    cls = {"GeminiStrategy": GeminiStrategy, "FullyShardedStrategy": FullyShardedStrategy}[entry]
    expected = rf"^{entry} runs ZeRO stage 3 .* engine_config.stage is 2"
    with pytest.raises(ValueError, match=expected):
        cls(engine_config=EngineConfig(stage=2, device=CPU))


@pytest.mark.parametrize("stage", [1, 2])
def test_the_callback_takes_the_stage_from_engine_config(stage: int) -> None:
    assert _callback(EngineConfig(stage=stage, device=CPU)).stage == stage
    # zero_stage given refines it.
    assert _callback(EngineConfig(stage=stage, device=CPU), zero_stage=1).stage == 1


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_the_device_is_the_frameworks(entry: str) -> None:
    # Each rank computes on the device its framework gives it, of engine_config's type.
    indexed = EngineConfig(stage=3, device=torch.device("cpu", 0))
    assert ENTRY_POINTS[entry](indexed).device == CPU
    meta = EngineConfig(stage=3, device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"engine_config.device is meta, but this rank computes"):
        ENTRY_POINTS[entry](meta)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_arguments_refine_engine_config(entry: str) -> None:
    given = EngineConfig(
        stage=3,
        device=CPU,
        chunking=Chunking(size_numel=512),
        placement=Placement(policy=HostPlacement(), disk_fraction=1.0, pin_memory=True),
        reduction=Reduction(bucket_bytes=4096),
    )
    # At their defaults the arguments keep engine_config's settings.
    assert replace(ENTRY_POINTS[entry](given), precision=given.precision) == given
    refined = {
        "GeminiStrategy": lambda: ENTRY_POINTS[entry](
            given, placement_policy="static", offload_optim_frac=1.0, chunk_size=1024
        ),
        "FullyShardedStrategy": lambda: ENTRY_POINTS[entry](
            given, cpu_offload=False, min_num_params=1024, bucket_cap_mb=1
        ),
        "ShardwiseCallback": lambda: ENTRY_POINTS[entry](
            given, placement_policy="static", chunk_size=1024
        ),
    }[entry]()
    assert refined.chunking.size_numel == 1024
    # The placement's other settings stay engine_config's.
    assert replace(refined.placement, policy=HostPlacement()) == given.placement
    if entry == "FullyShardedStrategy":
        assert refined.placement.policy.name == "cpu"  # cpu_offload=False is its default
        assert refined.reduction.bucket_bytes == 2**20
    else:
        assert isinstance(refined.placement.policy, StaticPlacement)
        assert refined.reduction == given.reduction


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_engine_config_of_another_type_is_refused(entry: str) -> None:
    cls = {"GeminiStrategy": GeminiStrategy, "FullyShardedStrategy": FullyShardedStrategy}.get(
        entry, ShardwiseCallback
    )
    expected = r"engine_config must be a shardwise.EngineConfig or None, got dict"
    with pytest.raises(TypeError, match=expected):
        cls(engine_config={"stage": 3})


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_precision_other_than_the_frameworks_is_refused(entry: str) -> None:
    bf16 = EngineConfig(stage=3, device=CPU, precision=MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError) as refused:
        if entry == "ShardwiseCallback":
            resolve(ShardwiseCallback(engine_config=bf16).options, _args(torch.float16))
        else:
            cls = GeminiStrategy if entry == "GeminiStrategy" else FullyShardedStrategy
            strategy = cls(engine_config=bf16)
            strategy.precision_plugin = ShardwisePrecision("16-mixed")
            strategy.engine_config(CPU)
    message = str(refused.value)
    assert "engine_config.precision stores parameters in torch.bfloat16" in message
    assert "asks for torch.float16: make the two agree" in message


def test_a_combination_the_engine_refuses_is_refused_at_construction() -> None:
    pooled = EngineConfig(stage=3, device=CPU, placement=Placement(host_buffer_pool=True))
    with pytest.raises(ValueError, match="host_buffer_pool=True with a device budget"):
        GeminiStrategy(engine_config=pooled, device_budget_bytes=2**20)


def test_the_callback_lists_the_engines_refusal_with_its_own() -> None:
    pooled = EngineConfig(stage=3, device=CPU, placement=Placement(host_buffer_pool=True))
    callback = ShardwiseCallback(engine_config=pooled, device_budget_bytes=2**20)
    with pytest.raises(ValueError) as refused:
        resolve(callback.options, SimpleNamespace(**vars(_args()), deepspeed="ds.json"))
    message = str(refused.value)
    assert "(2 problems)" in message
    assert "deepspeed is set" in message
    assert "host_buffer_pool=True with a device budget" in message


def test_without_engine_config_the_defaults_are_the_adapters() -> None:
    # GeminiStrategy's "auto" on a CPU host keeps chunks on the device; host copies are
    # pinned only where they feed a CUDA device.
    config = GeminiStrategy().engine_config(CPU)
    assert config.placement.policy.name == "cuda" and not config.placement.pin_memory
    assert config.chunking == Chunking(search_range_bytes=64 * 2**20, min_chunk_bytes=32 * 2**20)
    assert FullyShardedStrategy().engine_config(CPU).reduction.bucket_bytes == 25 * 2**20
