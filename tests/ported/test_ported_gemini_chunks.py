"""Ported from hpcaitech/ColossalAI (0.5):
- tests/test_zero/test_gemini/test_chunkv2.py (`exam_chunk_basic`): four parameters of shapes
  (8, 8, 8), (4, 4), (4, 8, 2) and (1, 1, 5) appended to a chunk of 1024 elements, sharded or
  kept gathered, the reduction synchronous or not: the chunk holds 597 elements; a sharded
  chunk keeps a world-th of its buffer per rank, a gathered one all of it, and the valid
  elements over the ranks sum to 597; a gather gives every parameter its values back; tensor states
  count what is in use and a chunk in use cannot be released; after a reduction each rank's
  slice holds the ranks' average;
- tests/test_zero/test_gemini/test_chunk_mgrv2.py (`exam_chunk_memory`): three 8x8 parameters
  in chunks of 128 elements: the bytes on the device and in host memory after packing, a
  gather, a release, and a move of the shards to host memory (a gathered chunk cannot move);
- tests/test_zero/test_gemini/test_search.py (`exam_search_chunk_size`,
  `exam_chunk_manager`): `search_chunk_configuration` on ColossalAI's GPT-2 (2 layers,
  n_embd 128, vocabulary 50258, tied embeddings) with `search_range_m=1`,
  `search_interval=128`, `min_chunk_size_m=0` chooses 527,872 elements, the original's number;
  and a GeminiDDP built from that configuration packs chunks of that size.

Translation: the original drives ColossalAI's `Chunk` / `ChunkManager` (append_tensor,
access_chunk, tensor_trans_state, reduce); the port drives ours (ChunkManager.register,
payload.gather / release, set_compute / set_hold, grads.add and the reduction), which packs
through the manager and broadcasts rank 0's values when a chunk closes (the original's
parameters differ per rank; its value checks were never asserted). `pin_memory` has no
meaning on a CPU host and is left out; `init_device` (CUDA or CPU) is the CPU here. Our
chunk's buffers hold the elements it packs rounded up to the world size (598 here) where
ColossalAI's hold its whole capacity (1024): the sizes and bytes are asserted as ours are,
the pattern of the bytes as the original's. The
ColossalAI chunk manager's `init_chunk_manager` is not offered: the port builds GeminiDDP from
the searched configuration instead. 2 ranks (the originals: 1, 2 and 4; 2; 1 and 4).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from shardwise import ChunkManager
from shardwise.chunk import ChunkState, Pool, TensorState
from shardwise.chunk.accounting import resident_bytes_by_pool
from shardwise.chunk.reduction import start_reduction
from shardwise.testing import run_ranks
from shardwise.zero import GeminiDDP
from shardwise.zero.gemini.chunk import search_chunk_configuration

CPU = torch.device("cpu")
SHAPES = [(8, 8, 8), (4, 4), (4, 8, 2), (1, 1, 5)]


def _states(chunk: object) -> dict[TensorState, int]:
    counts: dict[TensorState, int] = {}
    for info in chunk.tensors:  # type: ignore[attr-defined]
        counts[info.state] = counts.get(info.state, 0) + 1
    return counts


def _exam_chunk_basic() -> list[str]:
    world, rank = dist.get_world_size(), dist.get_rank()
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    for keep_gathered in (True, False):
        for async_op in (True, False):
            case = f"keep_gathered={keep_gathered} async={async_op}"
            torch.manual_seed(0)  # the same values on every rank (see the module note)
            params = [nn.Parameter(torch.randn(*shape)) for shape in SHAPES]
            copies = [p.detach().clone() for p in params]
            manager = ChunkManager(chunk_size_numel=1024, device=CPU, keep_gathered=keep_gathered)
            manager.register([(f"p{i}", p) for i, p in enumerate(params)])
            (chunk,) = manager.chunks
            check(chunk.numel == 597 and chunk.capacity_numel == 1024, f"{case}: sizes")
            # Buffers hold what the chunk holds, rounded up to the world size (see the note).
            padded = -(-597 // world) * world
            check(chunk.padded_numel == padded, f"{case}: padded {chunk.padded_numel}")
            if keep_gathered:
                check(chunk.payload.full.numel() == padded, f"{case}: gathered size")
            else:
                check(chunk.payload.shard.numel() == padded // world, f"{case}: shard size")
                check(chunk.payload.state is ChunkState.SHARDED, f"{case}: sharded")
            owned = sum(
                end - begin
                for index in range(len(params))
                if (span := chunk.tensor_shard_range(index)) is not None
                for begin, end in [span]
            )
            total = torch.tensor(owned)
            dist.all_reduce(total)
            check(int(total) == 597, f"{case}: valid elements over the ranks {int(total)}")
            chunk.payload.gather()
            faces = [info.param if keep_gathered else info.compute for info in chunk.tensors]
            check(all(torch.equal(f, c) for f, c in zip(faces, copies, strict=True)), case)
            check(_states(chunk) == {TensorState.HOLD: 4}, f"{case}: {_states(chunk)}")
            chunk.set_compute(0)
            check(
                _states(chunk) == {TensorState.HOLD: 3, TensorState.COMPUTE: 1},
                f"{case}: {_states(chunk)}",
            )
            if not keep_gathered:
                with pytest.raises(RuntimeError, match="in use"):
                    chunk.payload.release()
            chunk.set_hold(0)
            # Each rank's own gradients; the reduction leaves each its slice of the average.
            generator = torch.Generator().manual_seed(rank)
            grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
            for index, grad in enumerate(grads):
                chunk.grads.add(index, grad)
            everyone = [torch.cat([g.reshape(-1) for g in grads])]
            gathered = [torch.empty_like(everyone[0]) for _ in range(world)]
            dist.all_gather(gathered, everyone[0])
            average = torch.zeros(chunk.padded_numel)
            average[:597] = sum(gathered) / world  # type: ignore[operator]
            start_reduction([chunk], async_op=async_op).wait(keep_full=False)
            begin = chunk.shard_begin
            mine = chunk.grads.for_step()
            check(
                torch.allclose(mine, average[begin : begin + mine.numel()], atol=1e-6),
                f"{case}: reduced slice",
            )
            if not keep_gathered:
                chunk.payload.release()
                check(chunk.payload.state is ChunkState.SHARDED, f"{case}: released")
    return failures


# Bytes (device, host) after packing, after a gather, after a release, and after moving the
# shards to host memory, for sharded and gathered chunks on 2 ranks. The original's are
# 512 / 1024 where these are 384 / 768: its second chunk reserves all 128 elements for the
# one 8x8 parameter it holds, ours holds 64 (see the module note). A gathered chunk here also
# keeps its shard (1152 = 768 + 384), which ColossalAI drops while the chunk is whole.
MEMORY = {
    False: [(384, 0), (1152, 0), (384, 0), (0, 384)],
    True: [(768, 0), (768, 0), (768, 0), (768, 0)],
}


def _exam_chunk_memory() -> dict[bool, list[tuple[int, int]]]:
    seen: dict[bool, list[tuple[int, int]]] = {}
    for keep_gathered in (False, True):
        params = [nn.Parameter(torch.rand(8, 8)) for _ in range(3)]
        manager = ChunkManager(chunk_size_numel=128, device=CPU, keep_gathered=keep_gathered)
        manager.register([(f"p{i}", p.requires_grad_(False)) for i, p in enumerate(params)])
        for chunk in manager.chunks:
            chunk.place(payload=Pool.DEVICE, optim=Pool.DEVICE)

        def held(manager: ChunkManager = manager) -> tuple[int, int]:
            device = host = 0
            for chunk in manager.chunks:
                pools = resident_bytes_by_pool(chunk)
                device, host = device + pools[Pool.DEVICE], host + pools[Pool.HOST]
            return device, host

        record = [held()]
        for chunk in manager.chunks:
            chunk.payload.gather()
        record.append(held())
        for chunk in manager.chunks:
            if not chunk.keep_gathered:
                chunk.payload.release()
        record.append(held())
        for chunk in manager.chunks:
            if chunk.keep_gathered:
                with pytest.raises(ValueError, match="gathered"):
                    chunk.move_payload(Pool.HOST)
            else:
                chunk.move_payload(Pool.HOST)
        record.append(held())
        seen[keep_gathered] = record
    return seen


def _ported_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=2, n_head=4, n_embd=128, vocab_size=50258, attn_pdrop=0, embd_pdrop=0,
        resid_pdrop=0, summary_first_dropout=0, pad_token_id=50256, tie_word_embeddings=True,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _exam_search() -> tuple[int, int, list[int]]:
    model = _ported_gpt2()
    config, *_ = search_chunk_configuration(
        model, search_range_m=1, search_interval=128, min_chunk_size_m=0, filter_exlarge_params=True
    )
    world = dist.get_world_size()
    searched = config[world]["chunk_size"]
    config[world]["keep_gathered"] = False
    wrapped = GeminiDDP(model, config, mixed_precision=torch.float32)
    return world, searched, [c.capacity_numel for c in wrapped.chunk_manager.chunks]


def _all() -> tuple[list[str], dict[bool, list[tuple[int, int]]], tuple[int, int, list[int]]]:
    return _exam_chunk_basic(), _exam_chunk_memory(), _exam_search()


def test_chunks_pack_shard_gather_reduce_and_move_as_colossalai_tests_say() -> None:
    for basic, memory, (world, searched, capacities) in run_ranks(_all, 2):
        assert world == 2 and basic == []
        assert memory == MEMORY
        assert searched == 527872
        # The searched size for every chunk but those of parameters above it (the embedding,
        # which the search leaves out as extra large, gets one of its own).
        assert set(capacities) - {searched} == {50258 * 128}, capacities
