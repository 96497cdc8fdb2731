"""Whole state kept on rank 0 alone (`state_dict(only_rank_0=True)`,
`gather_optimizer_state(only_rank_0=True)`): in host memory each rank sends rank 0 the parts
of each tensor its shard holds, received there into tensors of their own (see [Note: gathering
to one rank] in chunk/whole_tensors.py).

After two AdamW steps, rank 0's dicts equal, key by key and to the bit (fp32 masters, bf16
payloads of frozen parameters cast to fp32, Adam's moments and steps, hyper-parameters), those
every rank gets with `only_rank_0=False` (the all-gather path); the other ranks get empty dicts.
Every tensor rank 0 gets has storage of its own, of its own size. The parts travel as GATHER
messages, no all-gather: rank 0 sends nothing, every other rank of the first shard group sends
its shards' bytes and receives nothing, and ranks of other shard groups (hybrid sharding) take
no part. Cases: stage 3 on 2 and 4 ranks (several chunks with padding), stage 2, bf16 with a
frozen layer, masters and optimizer state on the disk tier, and 4 ranks as 2 shard groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, adamw, batch_slice, make_model

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.checkpoint import gather_optimizer_state
from shardwise.testing import run_ranks

BF16 = MixedPrecision(param_dtype=torch.bfloat16)
CASES: dict[str, tuple[int, int, dict[str, Any]]] = {
    # name: (world size, stage, extra engine config)
    "stage3": (2, 3, {}),
    "stage3_4_ranks": (4, 3, {}),
    "stage2": (2, 2, {}),
    "bf16_frozen": (2, 3, {"mixed_precision": BF16, "frozen": True}),
    "disk": (2, 3, {"placement_policy": "cpu", "nvme_offload_fraction": 1.0}),
    "hybrid": (4, 3, {"shard_size": 2}),
}


def _case(name: str, directory: str) -> dict[str, Any]:
    _, stage, extra = CASES[name]
    extra = dict(extra)
    frozen = extra.pop("frozen", False)
    if "nvme_offload_fraction" in extra:
        extra["nvme_offload_dir"] = str(Path(directory) / f"disk{dist.get_rank()}")
    config: dict[str, Any] = {"device": torch.device("cpu"), **extra}
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    model = make_model(frozen=frozen)
    wrapped = zero_model_wrapper(model, stage, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = zero_optim_wrapper(
        wrapped,
        adamw(trainable),
        optim_config={"reduce_bucket_size": CHUNK_NUMEL + 7} if stage < 3 else None,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        optimizer.zero_grad()
        loss = wrapped(*batch_slice(step, 0, rank, world))
        optimizer.backward(loss)
        optimizer.step()
    stats = wrapped.comm_stats
    everywhere = {
        "model": wrapped.state_dict(only_rank_0=False),
        "optimizer": gather_optimizer_state(optimizer, only_rank_0=False),
    }
    stats.reset()
    on_first = {
        "model": wrapped.state_dict(only_rank_0=True),
        "optimizer": gather_optimizer_state(optimizer, only_rank_0=True),
    }
    traffic = stats.snapshot()
    # What this rank holds of the tensors (never its shard's padding): the model's values
    # as fp32, and Adam's two fp32 moments where the optimizer has state.
    manager = wrapped.chunk_manager
    owned = sum(
        end - begin
        for chunk in manager.chunks
        for index in range(len(chunk.tensors))
        for begin, end in [chunk.tensor_shard_range(index) or (0, 0)]
    )
    with_state = sum(
        view.numel() for view in optimizer.shard_views.values() if optimizer.optim.state.get(view)
    )
    return {
        "everywhere": everywhere,
        "on_first": on_first,
        "traffic": traffic,
        "own_bytes": 4 * owned + 2 * 4 * with_state,
        "frozen_dtypes": sorted(
            str(chunk.payload.shard.dtype)
            for chunk in wrapped.chunk_manager.chunks
            if not chunk.requires_grad
        ),
        "replica": 0 if extra.get("shard_size") is None else rank // extra["shard_size"],
    }


def _assert_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list):
        return [t for v in value for t in _tensors(v)]
    return []


@pytest.mark.parametrize("name", list(CASES))
def test_whole_state_on_rank_0_equals_the_all_gathered_one(name: str, tmp_path: Path) -> None:
    world = CASES[name][0]
    ranks = run_ranks(_case, world, name, str(tmp_path), timeout_s=120)
    first = ranks[0]
    _assert_equal(first["on_first"], first["everywhere"], name)
    assert first["everywhere"]["optimizer"]["state"], "the optimizer saved state"
    for tensor in _tensors(first["on_first"]):
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    if name == "bf16_frozen":
        assert set(first["frozen_dtypes"]) == {"torch.bfloat16"}
        assert all(t.dtype == torch.float32 for t in first["on_first"]["model"].values())
    for rank, result in enumerate(ranks):
        gathered = result["traffic"]
        assert gathered["all_gather"]["calls"] == 0, (rank, gathered)
        if rank == 0:
            assert gathered["gather"]["calls"] > 0
            assert gathered["gather"]["sent_bytes"] == 0
            continue
        assert result["on_first"] == {"model": {}, "optimizer": {}}, rank
        if result["replica"] != 0:
            assert gathered["gather"]["calls"] == 0, rank  # another shard group: no part
            continue
        assert gathered["gather"]["sent_bytes"] == result["own_bytes"] > 0, rank
