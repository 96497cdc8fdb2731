"""The wrapped model's inner module, called directly, behaves as the wrapper does.

Frameworks call it so: the Hugging Face Trainer evaluates `trainer.model`, and `generate()`
runs the inner model. At stage 3 its parameters are shards between calls, so the wrapper's
per-call work runs in hooks on the inner module (see [Note: the inner module works on its
own] in engine/model.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, batch_slice, make_model

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.chunk import ChunkState
from shardwise.testing import run_ranks


def _train(direct: bool) -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    wrapped = zero_model_wrapper(
        model,
        zero_stage=3,
        gemini_config={
            "device": torch.device("cpu"),
            "chunk_size_numel": CHUNK_NUMEL,
            # 16-bit storage, fp32 compute: the inputs cast and the fp32 outputs come from
            # the hooks too.
            "mixed_precision": MixedPrecision(
                param_dtype=torch.bfloat16, compute_dtype=torch.float32
            ),
            "force_outputs_fp32": True,
        },
    )
    optimizer = zero_optim_wrapper(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, evals, released = [], [], []
    for step in range(4):
        batch = batch_slice(step, 0, rank, world)
        optimizer.zero_grad()
        # Every other step, the first included (it records the execution order), runs the
        # inner module itself, with gradients.
        loss = wrapped.module(*batch) if direct and step % 2 == 0 else wrapped(*batch)
        optimizer.backward(loss)
        optimizer.step()
        losses.append(float(loss))
        with torch.no_grad():
            through_wrapper = float(wrapped(*batch))
            evals.append((float(wrapped.module(*batch)), through_wrapper))
        # Nothing stays gathered after a call of the inner module.
        released.append(
            all(c.payload.state is ChunkState.SHARDED for c in wrapped.chunk_manager.chunks)
        )
    return {"losses": losses, "evals": evals, "released": released, "state": wrapped.state_dict()}


def test_inner_module_called_directly_trains_and_evaluates_like_the_wrapper() -> None:
    direct = run_ranks(_train, 2, True)
    through_wrapper = run_ranks(_train, 2, False)
    for mixed, plain in zip(direct, through_wrapper, strict=True):
        assert mixed["losses"] == plain["losses"]
        for inner_loss, wrapper_loss in mixed["evals"]:  # type: ignore[attr-defined]
            assert inner_loss == wrapper_loss
        assert mixed["released"] == plain["released"] == [True] * 4
    state, reference = direct[0]["state"], through_wrapper[0]["state"]
    assert isinstance(state, dict) and isinstance(reference, dict)
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in state)
