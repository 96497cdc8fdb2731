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
