"""A backward pass that raises midway, caught on every rank, and training goes on.

A user's loop catches an exception from backward (a hook of theirs raising on a bad batch, an
out-of-memory error caught to skip the batch), calls `zero_grad()` and carries on. In a plain
torch loop that batch then leaves no trace: the next steps are exactly those of a run that
never saw it. The engine must forget the pass that raised the same way: reductions it had
issued, the chunks it had gathered for backward, the gradients routed so far, the phase of
the pass. The reference below is that plain torch loop, the same hook raising in it too
(each rank's slice in turn, gradients averaged over slices: data parallelism written out,
bit-identical at 2 ranks in fp32, see tests/helpers.py).

A loop that zeroes the gradients only after its step (`step(); zero_grad()`) and skips the
step of a batch that raised keeps that batch's partial gradients in `.grad`, and the next
backward adds onto them: the engine reduces what the raised pass left before its next pass,
so the next step sees the same sums. There the reference adds each rank's partial and next
gradients before averaging, the engine averages each pass and adds the averages: the same
sums in another order, so compared as the parity tests compare gradient accumulation (1e-5
on losses, 1e-4 on parameters, see tests/test_parity.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, adamw, batch_slice, make_model, max_abs_diff

from shardwise import ColoDDP, zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import run_ranks

STEPS = 5
RAISING_STEP = 2
WORLD = 2


class BadBatch(RuntimeError):
    """What the user's hook raises in backward."""


def _raise_midway(model: torch.nn.Module) -> Any:
    """A hook on the first block's output that raises when its gradient arrives: backward has
    by then produced the gradients of every later block and the head (and the engine reduced
    some of them), but not those of the first block and the embeddings."""

    def forward_hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        def raise_in_backward(grad: torch.Tensor) -> None:
            raise BadBatch("a bad batch")

        output.register_hook(raise_in_backward)

    return model.gpt.blocks[0].register_forward_hook(forward_hook)


def _plain_loop() -> tuple[list[float], dict[str, torch.Tensor], int]:
    """The loop a user writes without shardwise, every rank's slice in turn."""
    model = make_model()
    optimizer = adamw(model.parameters())
    losses, raised = [], 0
    for step in range(STEPS):
        optimizer.zero_grad()
        handle = _raise_midway(model) if step == RAISING_STEP else None
        grads: list[torch.Tensor | None] = [None for _ in model.parameters()]
        step_loss = torch.zeros(())
        try:
            for rank in range(WORLD):
                optimizer.zero_grad()
                loss = model(*batch_slice(step, 0, rank, WORLD))
                loss.backward()
                step_loss += loss.detach()
                for i, p in enumerate(model.parameters()):
                    if p.grad is not None:  # the model's unused branch gets none
                        grads[i] = p.grad.clone() if grads[i] is None else grads[i] + p.grad
        except BadBatch:
            raised += 1
            optimizer.zero_grad()
            continue
        finally:
            if handle is not None:
                handle.remove()
        for p, total in zip(model.parameters(), grads, strict=True):
            p.grad = None if total is None else total / WORLD
        optimizer.step()
        losses.append(float(step_loss / WORLD))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, raised


def _wrapped(
    stage: int, overlap: bool | None = None, placement: str = "cuda"
) -> tuple[Any, Any, Any]:
    """The test model wrapped at `stage`, its optimizer wrapped over it (`overlap`: the
    optimizer's overlap_communication, its default when None): (model, wrapped, optimizer)."""
    model = make_model()
    config: dict[str, Any] = {"device": torch.device("cpu"), "placement_policy": placement}
    if placement == "auto":  # a budget that holds about half the model's state
        config["device_budget_bytes"] = 200_000
    optim_config = None
    if stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    else:
        optim_config = {"reduce_bucket_size": CHUNK_NUMEL}
        if overlap is not None:
            optim_config["overlap_communication"] = overlap
    wrapped = zero_model_wrapper(model, stage, config)
    optimizer = zero_optim_wrapper(wrapped, adamw(model.parameters()), optim_config=optim_config)
    return model, wrapped, optimizer


def _sharded_loop(
    stage: int, overlap: bool, placement: str
) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """The same loop under shardwise, on this rank."""
    model, wrapped, optimizer = _wrapped(stage, overlap, placement)
    losses, raised = _skipping_the_bad_batch(model, wrapped, optimizer, optimizer.backward)
    return losses, wrapped.state_dict(only_rank_0=False), raised


def _skipping_the_bad_batch(
    model: torch.nn.Module, wrapped: Any, optimizer: Any, backward: Any
) -> tuple[list[float], int]:
    """The user's loop on this rank: the batch whose backward raises is skipped after
    zero_grad(); the losses of the steps taken, and how many batches raised."""
    rank = dist.get_rank()
    losses, raised = [], 0
    for step in range(STEPS):
        optimizer.zero_grad()
        handle = _raise_midway(model) if step == RAISING_STEP else None
        try:
            loss = wrapped(*batch_slice(step, 0, rank, WORLD))
            backward(loss)
        except BadBatch:
            raised += 1
            optimizer.zero_grad()
            continue
        finally:
            if handle is not None:
                handle.remove()
        step_loss = loss.detach().float()
        dist.all_reduce(step_loss)
        optimizer.step()
        losses.append(float(step_loss / WORLD))
    return losses, raised


@pytest.mark.parametrize(
    ("stage", "overlap", "placement"),
    [
        (1, False, "cuda"),
        (2, False, "cuda"),
        (2, True, "cuda"),
        (3, False, "cuda"),
        (3, False, "cpu"),
        (3, False, "auto"),
    ],
    ids=str,
)
def test_a_backward_that_raised_leaves_no_trace(stage: int, overlap: bool, placement: str) -> None:
    ref_losses, ref_state, ref_raised = _plain_loop()
    assert ref_raised == 1
    for losses, state, raised in run_ranks(_sharded_loop, WORLD, stage, overlap, placement):
        assert raised == 1
        assert losses == ref_losses
        assert max_abs_diff(state, ref_state) == 0.0


def _plain_loop_zeroing_after_step() -> tuple[list[float], dict[str, torch.Tensor]]:
    """`backward(); step(); zero_grad()`, a batch that raised skipped before its step: each
    rank's partial gradients stay and the next backward adds onto them."""
    model = make_model()
    optimizer = adamw(model.parameters())
    params = list(model.parameters())
    held: list[list[torch.Tensor | None]] = [[None] * len(params) for _ in range(WORLD)]
    losses = []
    for step in range(STEPS):
        handle = _raise_midway(model) if step == RAISING_STEP else None
        step_loss, raised = torch.zeros(()), False
        for rank in range(WORLD):
            for p, grad in zip(params, held[rank], strict=True):
                p.grad = None if grad is None else grad.clone()
            try:
                loss = model(*batch_slice(step, 0, rank, WORLD))
                loss.backward()
                step_loss += loss.detach()
            except BadBatch:
                raised = True
            held[rank] = [None if p.grad is None else p.grad.clone() for p in params]
        if handle is not None:
            handle.remove()
        if raised:
            continue
        for i, p in enumerate(params):
            grads = [held[rank][i] for rank in range(WORLD)]
            reached = [g for g in grads if g is not None]
            p.grad = sum(reached[1:], reached[0]) / WORLD if reached else None
        optimizer.step()
        optimizer.zero_grad()
        held = [[None] * len(params) for _ in range(WORLD)]
        losses.append(float(step_loss / WORLD))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded_loop_zeroing_after_step(stage: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank = dist.get_rank()
    model, wrapped, optimizer = _wrapped(stage)
    losses = []
    for step in range(STEPS):
        handle = _raise_midway(model) if step == RAISING_STEP else None
        try:
            loss = wrapped(*batch_slice(step, 0, rank, WORLD))
            optimizer.backward(loss)
        except BadBatch:
            continue
        finally:
            if handle is not None:
                handle.remove()
        step_loss = loss.detach().float()
        dist.all_reduce(step_loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(step_loss / WORLD))
    return losses, wrapped.state_dict(only_rank_0=False)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_backward_that_raised_keeps_its_partial_gradients_until_zero_grad(stage: int) -> None:
    ref_losses, ref_state = _plain_loop_zeroing_after_step()
    for losses, state in run_ranks(_sharded_loop_zeroing_after_step, WORLD, stage):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert max_abs_diff(state, ref_state) < 1e-4


def _colo_ddp_loop() -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Stage 0 (ColoDDP) under a plain torch optimizer, as its users write the loop."""
    model = make_model()
    wrapped = ColoDDP(model)
    optimizer = adamw(model.parameters())
    losses, raised = _skipping_the_bad_batch(model, wrapped, optimizer, wrapped.backward)
    return losses, {k: v.detach().clone() for k, v in wrapped.state_dict().items()}, raised


def test_colo_ddp_forgets_a_backward_that_raised_too() -> None:
    ref_losses, ref_state, _ = _plain_loop()
    for losses, state, raised in run_ranks(_colo_ddp_loop, WORLD):
        assert raised == 1
        assert losses == ref_losses
        assert max_abs_diff(state, ref_state) == 0.0
