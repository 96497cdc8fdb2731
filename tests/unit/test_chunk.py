"""Chunk packing, shard ranges, padding and state transitions on one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise import ChunkManager, CommOp
from shardwise.chunk import ChunkState, TensorState
from shardwise.chunk.reduction import reduce_now

CPU = torch.device("cpu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(3, 4))
    model[2].weight = nn.Parameter(model[0].weight.detach().t().contiguous()[:4, :3].clone())
    model[1].requires_grad_(False)
    return model


def test_packing_follows_order_separates_frozen_and_splits_at_capacity() -> None:
    model = _model()
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    manager = ChunkManager(chunk_size_numel=40, device=CPU, keep_gathered=True)
    manager.register(model.named_parameters())
    trainable = [c for c in manager.chunks if c.requires_grad]
    frozen = [c for c in manager.chunks if not c.requires_grad]
    assert [t.name for c in frozen for t in c.tensors] == ["1.weight", "1.bias"]
    assert [t.name for c in trainable for t in c.tensors] == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
    ]
    # 0.weight (32) + 0.bias (8) fill the first chunk; 2.weight (12) starts the next one.
    assert [c.numel for c in trainable] == [40, 16]
    # Parameters now view the chunk buffers and kept their values.
    for name, param in model.named_parameters():
        assert torch.equal(param, values[name])
        chunk, index = manager.locate(param)
        assert chunk.tensors[index].name == name


def test_tied_parameter_is_stored_once() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    manager = ChunkManager(chunk_size_numel=1000, device=CPU)
    manager.register(model.named_parameters(remove_duplicate=False))
    assert sum(len(c.tensors) for c in manager.chunks) == 1
    assert manager.locate(model[0].weight) == manager.locate(model[1].weight)


def test_large_parameter_gets_its_own_chunk() -> None:
    model = nn.Linear(10, 10)
    manager = ChunkManager(chunk_size_numel=16, device=CPU)
    manager.register(model.named_parameters())
    assert [c.capacity_numel for c in manager.chunks] == [100, 16]


def test_sharded_chunk_releases_and_gathers_and_counts_bytes() -> None:
    model = nn.Linear(3, 3)
    expected = model.weight.detach().clone()
    manager = ChunkManager(chunk_size_numel=64, device=CPU, keep_gathered=False)
    manager.register(model.named_parameters())
    chunk = manager.chunks[0]
    assert chunk.payload.state is ChunkState.SHARDED
    assert all(t.state is TensorState.FREE for t in chunk.tensors)
    assert chunk.payload.full.untyped_storage().size() == 0
    # The parameters are sharded faces: they keep their shape but hold no element, never
    # freed memory, and any use of their values raises. Their compute faces view the buffer.
    assert model.weight.shape == (3, 3) and model.weight.dim() == 2
    assert model.weight.data.numel() == 0
    with pytest.raises(RuntimeError, match="released"):
        model.weight.sum()
    face = chunk.tensors[0].compute
    assert face is not model.weight and type(face) is nn.Parameter and face.shape == (3, 3)
    assert face.untyped_storage().data_ptr() == chunk.payload.full.untyped_storage().data_ptr()
    chunk.payload.gather()
    assert chunk.payload.state is ChunkState.GATHERED
    assert torch.equal(face, expected)
    assert chunk.tensors[0].compute is face  # the same tensor, refilled
    with pytest.raises(RuntimeError, match="released"):
        model.weight.sum()  # the sharded face is registered outside its gather unit
    assert manager.stats.calls(CommOp.ALL_GATHER) == 1
    chunk.set_compute(0)
    with pytest.raises(RuntimeError, match="in use"):
        chunk.payload.release()
    chunk.set_hold(0)
    chunk.payload.release()
    with pytest.raises(RuntimeError, match="not gathered"):
        chunk.set_compute(0)


def test_shard_ranges_cover_each_tensor_once() -> None:
    model = nn.Linear(5, 7)
    manager = ChunkManager(chunk_size_numel=1000, device=CPU, keep_gathered=True)
    manager.register(model.named_parameters())
    chunk = manager.chunks[0]
    # One process owns everything; padding rounds up to the world size (1 here).
    assert chunk.padded_numel == chunk.numel == 42
    assert chunk.tensor_shard_range(0) == (0, 35)
    assert chunk.tensor_shard_range(1) == (35, 42)


def test_bad_chunk_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"chunk_size_numel must be a positive int, got 0"):
        ChunkManager(chunk_size_numel=0, device=CPU)
    with pytest.raises(TypeError, match=r"device must be a torch\.device"):
        ChunkManager(chunk_size_numel=4, device="cpu")  # type: ignore[arg-type]


def test_gradient_buffer_is_exact_without_being_zeroed_first() -> None:
    """First gradients are copied into an uninitialised buffer, later ones added; what got
    none is zero when the buffer is reduced (see [Note: gradient buffers start
    uninitialised])."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    manager = ChunkManager(chunk_size_numel=100, device=CPU, keep_gathered=True)
    manager.register(model.named_parameters())
    (chunk,) = manager.chunks
    grads = [torch.randn(info.shape) for info in chunk.tensors]
    chunk.grads.add(0, grads[0])
    chunk.grads.add(2, grads[2])
    chunk.grads.add(2, grads[2])  # a second gradient in the same pass adds
    expected = torch.zeros(chunk.padded_numel)
    for index, scale in ((0, 1.0), (2, 2.0)):
        info = chunk.tensors[index]
        expected[info.offset : info.offset + info.numel] = scale * grads[index].reshape(-1)
    chunk.grads.end_pass()  # kept for the next pass: made whole now
    assert torch.equal(chunk.grads.full, expected)
    chunk.grads.add(1, grads[1])  # the next pass adds onto the kept buffer
    info = chunk.tensors[1]
    expected[info.offset : info.offset + info.numel] += grads[1].reshape(-1)
    assert torch.equal(chunk.grads.prepare_reduce(), expected)


def test_zero_unwritten_covers_gaps_and_padding() -> None:
    from shardwise.chunk.grad_buffer import zero_unwritten
    from shardwise.chunk.states import TensorInfo

    param = nn.Parameter(torch.zeros(1))
    tensors = [
        TensorInfo(name, param, offset, numel, torch.Size([numel]), TensorState.HOLD, param)
        for name, offset, numel in (("a", 0, 3), ("b", 3, 2), ("c", 6, 2))
    ]
    buffer = torch.full((10,), 7.0)
    zero_unwritten(buffer, tensors, {0, 2})
    assert buffer.tolist() == [7, 7, 7, 0, 0, 0, 7, 7, 0, 0]


def test_zero_grad_lets_the_next_reduced_gradients_overwrite_the_shard() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5))
    manager = ChunkManager(chunk_size_numel=100, device=CPU, keep_gathered=True)
    manager.register(model.named_parameters())
    (chunk,) = manager.chunks
    grads = [torch.randn(info.shape) for info in chunk.tensors]

    def backward() -> None:
        for index, grad in enumerate(grads):
            chunk.grads.add(index, grad)
        reduce_now([chunk], keep_full=False)

    whole = torch.cat([g.reshape(-1) for g in grads])
    backward()
    backward()  # accumulates
    assert torch.equal(chunk.grads.for_step()[: whole.numel()], 2 * whole)
    chunk.grads.zero_grad()
    backward()  # overwrites what the shard held
    assert torch.equal(chunk.grads.for_step()[: whole.numel()], whole)
    chunk.grads.zero_grad()
    assert chunk.grads.cleared
    assert not chunk.grads.for_step().any()  # no gradient since: zeros at the step
    assert not chunk.grads.cleared


def test_stage1_gradient_shard_is_its_own_slice_of_the_whole_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5))
    manager = ChunkManager(chunk_size_numel=100, device=CPU, keep_gathered=True)
    manager.register(model.named_parameters())
    (chunk,) = manager.chunks
    chunk.share_grad_shard_with_full()
    assert chunk.grads.full is not None
    assert chunk.grads.shard.untyped_storage().data_ptr() == (
        chunk.grads.full.untyped_storage().data_ptr()
    )
    grads = [torch.randn(info.shape) for info in chunk.tensors]
    whole = torch.cat([g.reshape(-1) for g in grads])
    for _ in range(2):
        for index, grad in enumerate(grads):
            chunk.grads.add(index, grad)
        reduce_now([chunk], keep_full=True)  # stage 1 reduces at the step and keeps the buffer
        assert torch.equal(chunk.grads.for_step()[: whole.numel()], whole)
        # The next backward would add onto the reduced slice: refused until zero_grad().
        with pytest.raises(ValueError, match="zero_grad"):
            chunk.grads.add(0, grads[0])
        chunk.grads.zero_grad()
        assert not chunk.grads.full.any()


def test_stage1_averaged_gradients_are_what_grad_views_until_the_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5))
    manager = ChunkManager(chunk_size_numel=100, device=CPU, keep_gathered=True)
    manager.register(model.named_parameters())
    (chunk,) = manager.chunks
    chunk.keep_averaged_grads()
    grads = chunk.grads
    assert grads.full is not None and grads.exposes
    assert grads.shard.untyped_storage().data_ptr() == grads.full.untyped_storage().data_ptr()
    local = [torch.randn(info.shape) for info in chunk.tensors]
    whole = torch.cat([g.reshape(-1) for g in local])
    for index, grad in enumerate(local):  # what the gradient hook does
        grads.add(index, grad)
        chunk.tensors[index].compute.grad = grads.exposed(index)
    reduce_now([chunk], keep_full=False)  # one rank: the average is the sum itself
    assert grads.full is not None  # kept whatever keep_full says: `.grad` views it
    assert torch.equal(grads.for_step()[: whole.numel()], whole)
    for info, grad in zip(chunk.tensors, local, strict=True):
        assert info.compute.grad is not None and torch.equal(info.compute.grad, grad)
    # A later backward accumulates onto the average in place, as autograd does into `.grad`.
    for index, grad in enumerate(local):
        view = chunk.tensors[index].compute.grad
        assert view is not None
        view.add_(grad)
        grads.add(index, view)
    reduce_now([chunk], keep_full=False)
    assert torch.equal(grads.for_step()[: whole.numel()], 2 * whole)
    # The step may scale this rank's slice in place: `.grad` is hidden, backward refused.
    grads.end_step()
    assert all(info.compute.grad is None for info in chunk.tensors)
    with pytest.raises(ValueError, match="zero_grad"):
        grads.add(0, local[0])
    grads.zero_grad()
    assert not grads.full.any()
    grads.add(0, local[0])


def test_payload_gather_fills_the_compute_copy_and_quantized_wires_are_built() -> None:
    from shardwise.chunk import ChunkDtypes
    from shardwise.chunk.wire import PayloadGather, QuantizedGather, QuantizedReduce, WireFormats
    from shardwise.comm.quantize import BlockQuantizer

    model = nn.Linear(3, 2)
    fp16 = ChunkDtypes(payload=torch.float16, compute=torch.float32, reduce=torch.float16)
    manager = ChunkManager(chunk_size_numel=100, device=CPU, dtypes=fp16, keep_gathered=True)
    manager.register(model.named_parameters())
    (chunk,) = manager.chunks
    assert isinstance(chunk.wire.gather, PayloadGather)
    # The parameters compute with the fp32 copy cast from the 16-bit payload.
    assert model.weight.dtype == torch.float32
    assert torch.equal(model.weight.detach().reshape(-1), chunk.payload.full[:6].float())
    int8 = BlockQuantizer("int8", 4)
    quantized = ChunkManager(
        chunk_size_numel=100,
        device=CPU,
        keep_gathered=True,
        wire=WireFormats(gather=int8, reduce=int8),
    )
    quantized.register(nn.Linear(3, 2).named_parameters())
    assert isinstance(quantized.chunks[0].wire.gather, QuantizedGather)
    assert isinstance(quantized.chunks[0].wire.reduce, QuantizedReduce)
