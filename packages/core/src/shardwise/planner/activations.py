"""What a step's activations take, estimated from the model and an input before training.

[Note: estimating activations]
A plan for the device needs the activations beside the model state: what the forward keeps
for backward (the tensors autograd saves), and the output and its gradient. They depend on the
model's code and the batch, so they are measured the way autograd sees them: the forward (and
the loss, where the model returns one) runs once with `saved_tensors_hooks` counting the bytes
of every distinct storage saved for backward, plus the output's bytes twice (it and its
gradient live together when backward starts). On a model built on the meta device with inputs
on the meta device nothing is allocated and nothing computed, so a 10B-parameter model is
estimated in seconds on any host. Activation checkpointing is seen as it runs: its regions save
only their inputs, and backward recomputes one region at a time, so the largest region's own
activations come on top; `checkpointed_region_bytes` measures that by running each region's
module once outside checkpointing (regions found by the modules the model marks, as Hugging
Face models do with `gradient_checkpointing`). Attention is counted as the fused kernels of a
GPU keep it (query, key, value, output and each row's log-sum-exp): on the meta device
`scaled_dot_product_attention` would otherwise take its reference path, which keeps the whole
attention matrix (a 10.8B Llama at batch 8 x 1024 would be overestimated by some 28 GB). It is
an estimate: allocator rounding, kernels' workspaces and temporaries that live only inside one
operation are not counted.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True, slots=True)
class ActivationEstimate:
    """Bytes of a step's activations on the device.

    Attributes:
        saved_bytes: what the forward keeps for backward (distinct storages).
        output_bytes: the forward's floating-point outputs (counted twice in `total_bytes`:
            with their gradients).
        recompute_bytes: under activation checkpointing, the largest checkpointed region's
            own activations, recomputed in backward (0 without checkpointing).
    """

    saved_bytes: int
    output_bytes: int
    recompute_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.saved_bytes + 2 * self.output_bytes + self.recompute_bytes


def estimate_activation_bytes(
    model: nn.Module, *args: Any, loss: Callable[[Any], torch.Tensor] | None = None, **kwargs: Any
) -> ActivationEstimate:
    """Run `model(*args, **kwargs)` once (and `loss(output)`, or the output's `.loss`, when
    there is one) counting what autograd saves for backward (see [Note: estimating
    activations]). Build the model and the inputs on the meta device to allocate nothing.

    Args:
        model: the model, in training mode as it will train (dropout and checkpointing as
            they will run).
        *args, **kwargs: one micro-batch of inputs, as the training loop passes them.
        loss: turns the output into the loss backward starts from, where the model does not
            return it itself.
    """
    saved, output_bytes = _saved_by_forward(model, args, kwargs, loss)
    return ActivationEstimate(
        saved_bytes=saved,
        output_bytes=output_bytes,
        recompute_bytes=_largest_region(model, args, kwargs),
    )


def estimate_token_activation_bytes(
    model: nn.Module, *, batch_size: int, seq_len: int
) -> ActivationEstimate:
    """`estimate_activation_bytes` for a model that reads token ids, at `batch_size` sequences
    of `seq_len` tokens: the inputs are built on the model's device (nothing allocated on the
    meta device) from what its forward accepts, `input_ids` (batch_size, seq_len) as a keyword
    where the forward names it (else positionally), `labels` the same where it takes them (a
    Hugging Face causal LM then returns its loss, which is counted), and where it takes an
    `attention_mask`, a 4-D one: Hugging Face's preparation of a 2-D mask reads its values,
    which meta tensors have not.

    Args:
        model: the model, in training mode and with checkpointing as it will train, in the
            dtype its forward computes in (the mask takes its floating-point parameters' dtype).
        batch_size: sequences in one micro-batch (per rank).
        seq_len: tokens per sequence.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"batch_size and seq_len must be positive ints, got {batch_size} and {seq_len}"
        )
    parameters = list(model.parameters())
    device = parameters[0].device if parameters else torch.device("meta")
    dtype = next((p.dtype for p in parameters if p.is_floating_point()), torch.get_default_dtype())
    accepted = inspect.signature(model.forward).parameters
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)  # (B, T)
    args: tuple[torch.Tensor, ...] = ()
    kwargs: dict[str, Any] = {}
    if "input_ids" in accepted:
        kwargs["input_ids"] = ids
    else:
        args = (ids,)
    if "labels" in accepted:
        kwargs["labels"] = ids
    if "attention_mask" in accepted:  # (B, 1, T, T), additive: zeros attend everywhere
        kwargs["attention_mask"] = torch.zeros(
            batch_size, 1, seq_len, seq_len, dtype=dtype, device=device
        )
    return estimate_activation_bytes(model, *args, **kwargs)


class _SavedBytes:
    """Bytes of the distinct storages autograd saves while it is installed, parameters,
    buffers and the inputs left out; counted per region too, while regions are open."""

    def __init__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Parameters, buffers and the inputs are saved for backward too: not activations.
        self._held = {
            _storage_key(t)
            for t in [*model.parameters(), *model.buffers(), *_tensors(args), *_tensors(kwargs)]
        }
        self.storages: dict[int, int] = {}
        self.regions: list[dict[int, int]] = []  # open regions, innermost last
        self.closed: list[int] = []  # the bytes of each region once closed

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in self._held:
            nbytes = tensor.untyped_storage().nbytes()
            self.storages[key] = nbytes
            if self.regions:
                self.regions[-1][key] = nbytes
        return tensor

    def open(self, module: nn.Module, inputs: Any) -> None:
        self.regions.append({})

    def close(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self.closed.append(sum(self.regions.pop().values()))

    @contextmanager
    def counting(self) -> Iterator[None]:
        with (
            torch.enable_grad(),
            _fused_attention_on_meta(),
            torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t),
        ):
            yield


def _saved_by_forward(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss: Callable[[Any], torch.Tensor] | None,
) -> tuple[int, int]:
    saved = _SavedBytes(model, args, kwargs)
    with saved.counting():
        output = model(*args, **kwargs)
        if loss is not None:
            loss(output)  # what the loss saves is counted; its value is not needed
    outputs = [t for t in _tensors(output) if t.is_floating_point()]
    return sum(saved.storages.values()), sum(t.numel() * t.element_size() for t in outputs)


def _largest_region(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The largest activation-checkpointed region's own saved bytes, measured by running the
    model once with its checkpointing off and counting per region; 0 where nothing is
    checkpointed."""
    marked = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not marked:
        return 0
    saved = _SavedBytes(model, args, kwargs)
    regions = list(
        dict.fromkeys(child for region in marked for child in _checkpointed_children(region))
    )
    handles = [m.register_forward_pre_hook(saved.open) for m in regions]
    handles += [m.register_forward_hook(saved.close) for m in regions]
    for module in marked:
        setattr(module, "gradient_checkpointing", False)  # noqa: B010 (a plain attribute)
    try:
        with saved.counting():
            model(*args, **kwargs)
    finally:
        for module in marked:
            setattr(module, "gradient_checkpointing", True)  # noqa: B010
        for handle in handles:
            handle.remove()
    return max(saved.closed, default=0)


class _FusedAttentionShape(torch.autograd.Function):
    """Attention on meta tensors as a fused kernel keeps it for backward: its output's shape,
    saving the query, key, value, output and a float32 log-sum-exp per row."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        shape = (*query.shape[:-1], value.shape[-1])
        if query.dim() == 4:  # laid out (batch, sequence, heads, dim), as the kernels write it
            batch, heads, sequence, dim = shape
            out = query.new_empty((batch, sequence, heads, dim)).transpose(1, 2)
        else:
            out = query.new_empty(shape)
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


@contextmanager
def _fused_attention_on_meta() -> Iterator[None]:
    original = F.scaled_dot_product_attention

    def attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if query.device.type != "meta":
            return original(query, key, value, *args, **kwargs)
        if key.shape[-3] != query.shape[-3] and kwargs.get("enable_gqa"):
            repeat = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(repeat, dim=-3)
            value = value.repeat_interleave(repeat, dim=-3)
        out: torch.Tensor = _FusedAttentionShape.apply(query, key, value)
        return out

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in `value` (nested containers, and the values of a model's output object)."""
    if not isinstance(value, (dict, torch.Tensor)) and callable(getattr(value, "values", None)):
        value = list(value.values())  # a Hugging Face ModelOutput
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _storage_key(tensor: torch.Tensor) -> int:
    """The storage's own identity: meta tensors have no address to tell them apart by."""
    return int(tensor.untyped_storage()._cdata)


def _checkpointed_children(region: nn.Module) -> list[nn.Module]:
    """The modules a region checkpoints one by one: a Hugging Face model marks its decoder
    layers themselves (`GradientCheckpointingLayer`), or the model whose layers it loops."""
    layers = [
        child
        for child in region.modules()
        if child is not region and type(child).__name__.endswith(("Layer", "Block"))
    ]
    return layers or [region]


__all__ = ["ActivationEstimate", "estimate_activation_bytes", "estimate_token_activation_bytes"]
