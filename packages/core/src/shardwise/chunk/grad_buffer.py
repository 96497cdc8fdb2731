"""A chunk's gradient buffer, filled without zeroing it first.

[Note: gradient buffers start uninitialised]
A chunk's gradient buffer is allocated empty when its first gradient of a backward arrives;
each tensor's first gradient is copied in and later ones are added. Zeroing the whole buffer
first and adding every gradient costs a write pass over the chunk and, on a CPU, 2.5 times the
time (8 MiB: 2.0 ms against 0.8 ms). What no gradient reached (padding, an unused branch, a
frozen tensor) is zeroed before the buffer is reduced or kept for the next pass.

[Note: a gradient that is the whole buffer]
A chunk holding one tensor whose elements fill it (a large embedding or output head has a chunk
of its own) would copy autograd's gradient into a buffer of the same size and then drop it:
for that moment the largest gradient of the model is held twice. When autograd's gradient owns
its memory outright (contiguous, a storage of its own size that no other tensor shares, in the
reduction dtype on the chunk's device), the chunk takes it as its gradient buffer instead.
"""

from __future__ import annotations

import torch

from shardwise.chunk.states import TensorInfo


def zero_unwritten(buffer: torch.Tensor, tensors: list[TensorInfo], written: set[int]) -> None:
    """Zero every element of `buffer` outside the tensors whose indices are in `written`."""
    covered = sorted((tensors[i].offset, tensors[i].offset + tensors[i].numel) for i in written)
    position = 0
    for begin, end in covered:
        if begin > position:
            buffer[position:begin].zero_()
        position = max(position, end)
    if position < buffer.numel():
        buffer[position:].zero_()


def owns_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is the only tensor over a storage of exactly its own elements, so a
    holder may keep and change it in place without anyone else seeing it."""
    storage = tensor.untyped_storage()
    if (
        tensor.storage_offset() != 0
        or not tensor.is_contiguous()
        or storage.nbytes() != tensor.numel() * tensor.element_size()
    ):
        return False
    # The storage's references: this tensor's and the Python object `storage` just made.
    return bool(torch._C._storage_Use_Count(storage._cdata) <= 2)
