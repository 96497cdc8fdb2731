"""`StreamingCheckpointIO`, the shardwise strategies' default CheckpointIO: a local file holds
exactly the bytes Lightning's `TorchCheckpointIO` writes for the same checkpoint (tensors of
several dtypes, views sharing a storage, nested Python values), written under a hidden name
beside it and renamed over it: a save that fails leaves the previous file as it was and no
partial file. `storage_options` is refused as Lightning's refuses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_fabric.plugins import TorchCheckpointIO

from shardwise_lightning import StreamingCheckpointIO


def _checkpoint() -> dict[str, Any]:
    torch.manual_seed(0)
    shared = torch.randn(64)
    return {
        "state_dict": {
            "w": torch.randn(16, 8),
            "half": torch.randn(5).to(torch.bfloat16),
            "first": shared[:32],
            "second": shared[32:],
        },
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}],
        "loops": {"fit_loop": {"epoch": 2, "name": "x" * 100}},
        "epoch": 2,
    }


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("cannot pickle this")


def test_writes_the_bytes_lightning_writes(tmp_path: Path) -> None:
    checkpoint = _checkpoint()
    TorchCheckpointIO().save_checkpoint(checkpoint, tmp_path / "lightning.ckpt")
    StreamingCheckpointIO().save_checkpoint(checkpoint, tmp_path / "sub" / "ours.ckpt")
    ours = (tmp_path / "sub" / "ours.ckpt").read_bytes()
    assert ours == (tmp_path / "lightning.ckpt").read_bytes()
    loaded = StreamingCheckpointIO().load_checkpoint(tmp_path / "sub" / "ours.ckpt")
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], value), key
    assert loaded["loops"] == checkpoint["loops"]
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["ours.ckpt"]


def test_a_failed_save_leaves_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    io = StreamingCheckpointIO()
    io.save_checkpoint(_checkpoint(), target)
    before = target.read_bytes()
    with pytest.raises(RuntimeError, match="cannot pickle"):
        io.save_checkpoint({**_checkpoint(), "bad": _Unpicklable()}, target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_storage_options_are_refused_as_lightning_refuses_them(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="storage_options"):
        StreamingCheckpointIO().save_checkpoint(_checkpoint(), tmp_path / "x.ckpt", {"a": 1})
