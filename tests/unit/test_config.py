"""Validation of the engine's configuration objects."""

from __future__ import annotations

import pytest
import torch

from shardwise import Chunking, EngineConfig, MixedPrecision, Overlap
from shardwise.chunk import ChunkDtypes


def test_mixed_precision_defaults_and_loss_scaling() -> None:
    assert MixedPrecision().chunk_dtypes() == ChunkDtypes(
        torch.float32, torch.float32, torch.float32
    )
    fp16 = MixedPrecision(param_dtype=torch.float16, compute_dtype=torch.float32)
    assert fp16.chunk_dtypes() == ChunkDtypes(torch.float16, torch.float32, torch.float16)
    assert fp16.uses_loss_scaling
    assert not MixedPrecision(param_dtype=torch.bfloat16).uses_loss_scaling


def test_bad_dtypes_and_stages_are_refused() -> None:
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(TypeError, match=r"compute_dtype must be a torch\.dtype"):
        MixedPrecision(compute_dtype="fp32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"zero_stage must be 0, 1, 2 or 3, got 5"):
        EngineConfig(stage=5, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="chunk size must be at least 1"):
        EngineConfig(stage=3, device=torch.device("cpu"), chunking=Chunking(size_numel=0))


def test_overlap_param_gather_is_refused_at_stage_3() -> None:
    cpu = torch.device("cpu")
    gathered = Overlap(param_gather=True)
    assert EngineConfig(stage=2, device=cpu, overlap=gathered).overlap.param_gather
    with pytest.raises(ValueError, match="overlap_param_gather applies to stages 1 and 2"):
        EngineConfig(stage=3, device=cpu, overlap=gathered)


def test_wire_formats_are_checked_and_refused_where_they_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from shardwise.chunk.wire import WireFormats
    from shardwise.comm import ReduceScatterMethod
    from shardwise.comm.quantize import BlockQuantizer
    from shardwise.engine import Communication, Reduction
    from shardwise.zero.front_door import engine_config

    cpu = torch.device("cpu")
    off = Communication()
    assert not off.quantizes
    assert off.wire_formats(ReduceScatterMethod.ALL_TO_ALL).gather is None
    wire = Communication(gather="int8", reduce="fp8", block_numel=64).wire_formats(
        ReduceScatterMethod.NATIVE
    )
    assert wire.gather == BlockQuantizer("int8", 64) and wire.reduce == BlockQuantizer("fp8", 64)
    with pytest.raises(ValueError, match=r"gather_format must be one of .* got 'int2'"):
        Communication(gather="int2")
    # int4 reduces gradients; gathering weights in it is refused, naming what to use.
    assert Communication(reduce="int4").wire_formats(
        ReduceScatterMethod.ALL_TO_ALL
    ).reduce == BlockQuantizer("int4", 256)
    with pytest.raises(ValueError, match=r"gather_format='int4' is not offered.*'int8'"):
        Communication(gather="int4")
    with pytest.raises(ValueError, match=r"gather must quantize to one of \('int8', 'fp8'\)"):
        WireFormats(gather=BlockQuantizer("int4", 64))
    with pytest.raises(ValueError, match=r"reduce_format must be one of .* got 'int2'"):
        Communication(reduce="int2")
    with pytest.raises(ValueError, match=r"reduce_format must be one of .* got 'bf16'"):
        Communication(reduce="bf16")
    with pytest.raises(ValueError, match="quant_block_numel must be a positive int, got 0"):
        Communication(block_numel=0)
    with pytest.raises(ValueError, match=r"stage 0 .* gathers nothing"):
        EngineConfig(stage=0, device=cpu, communication=Communication(gather="int8"))
    with pytest.raises(ValueError, match="leave it 'auto' or set 'all_to_all'"):
        EngineConfig(
            stage=2,
            device=cpu,
            reduction=Reduction(method="reduce_scatter"),
            communication=Communication(reduce="int8"),
        )
    # A device whose torch cannot cast to fp8 refuses it, naming the format to use instead.
    monkeypatch.setattr("shardwise.engine.config.fp8_casts_work", lambda device: False)
    with pytest.raises(ValueError, match="use 'int8' instead"):
        EngineConfig(stage=3, device=cpu, communication=Communication(gather="fp8"))
    assert EngineConfig(stage=3, device=cpu, communication=Communication(gather="int8"))
    # gemini_config's keys, at stage 3 and at stages 1-2.
    config = engine_config(3, {"device": cpu, "gather_format": "int8", "quant_block_numel": 32})
    assert config.communication == Communication(gather="int8", block_numel=32)
    assert engine_config(2, {"device": cpu, "reduce_format": "int8"}).communication.reduce == "int8"
    for stage in (1, 2, 3):
        assert engine_config(stage, {"device": cpu, "reduce_format": "int4"}).communication == (
            Communication(reduce="int4")
        )
        with pytest.raises(ValueError, match="gather_format='int4' is not offered"):
            engine_config(stage, {"device": cpu, "gather_format": "int4"})
    with pytest.raises(ValueError, match=r"reduce_format='int4' exchanges .* 'all_to_all'"):
        EngineConfig(
            stage=3,
            device=cpu,
            reduction=Reduction(method="reduce_scatter"),
            communication=Communication(reduce="int4"),
        )
    with pytest.raises(ValueError, match=r"stage 0 .* gathers nothing"):
        EngineConfig(stage=0, device=cpu, communication=Communication(reduce="int4"))
    with pytest.raises(TypeError, match=r"gather_format must be a str, one of .* got bool True"):
        engine_config(1, {"device": cpu, "gather_format": True})
    with pytest.raises(TypeError, match=r"quant_block_numel must be a positive int .* got float"):
        engine_config(3, {"device": cpu, "quant_block_numel": 256.0})


def test_communication_settings_are_one_check_for_every_front_door() -> None:
    """`communication_settings` is what the wrappers, plugins and adapters call: the formats
    and block size as given, ColossalAI's fp8_communication as both formats in fp8, and bad
    values refused with the setting, the value and the caller named."""
    from shardwise.engine import Communication
    from shardwise.engine.communication import communication_settings
    from shardwise.zero.front_door import engine_config

    assert communication_settings() == Communication()
    assert communication_settings(
        gather_format="int8", reduce_format="fp8", quant_block_numel=64
    ) == Communication(gather="int8", reduce="fp8", block_numel=64)
    assert communication_settings(fp8_communication=True, quant_block_numel=32) == (
        Communication(gather="fp8", reduce="fp8", block_numel=32)
    )
    with pytest.raises(TypeError, match=r"^Plugin: fp8_communication must be a bool, got 1$"):
        communication_settings(fp8_communication=1, caller="Plugin")
    with pytest.raises(
        ValueError,
        match=r"fp8_communication=True means gather_format='fp8' and reduce_format='fp8'; "
        r"it cannot be combined with reduce_format='int8'",
    ):
        communication_settings(fp8_communication=True, reduce_format="int8")
    with pytest.raises(ValueError, match=r"^X: gather_format must be one of .* got 'off'$"):
        communication_settings(gather_format="off", caller="X")
    with pytest.raises(TypeError, match=r"^X: reduce_format must be a str, .* got NoneType None"):
        communication_settings(reduce_format=None, caller="X")
    with pytest.raises(ValueError, match="quant_block_numel must be a positive int, got -1"):
        communication_settings(quant_block_numel=-1)
    # ColossalAI's fp8_communication, which its gemini_config passes on to GeminiDDP.
    fp8 = engine_config(2, {"device": torch.device("cpu"), "fp8_communication": True})
    assert (fp8.communication.gather, fp8.communication.reduce) == ("fp8", "fp8")
