"""Ported from hpcaitech/ColossalAI, tests/test_ddp/test_ddp_ignore_params.py (0.2.x).

A two-layer net whose second weight is marked with `set_params_to_ignore` before wrapping, built
from a different seed on each rank, one backward on each rank's own input. Kept: for `ColoDDP`
and `ZeroDDP`, the non-ignored weight's gradient is the same on every rank and the ignored
weight's gradient is not.

Deliberate difference: ColossalAI's ZeroDDP leaves the reduced fp16 gradient in the parameter's
storage (the original reads `w1` for it); our GeminiDDP keeps reduced gradients in the chunks'
shards, so the port assembles w1's whole reduced gradient from every rank's shard. Assembled
that way it is the same on every rank by construction, so the port also checks (for both
wrappers) that it is the data-parallel gradient: the mean of the ranks' local gradients, taken
from a plain copy of the net.

Added (the numerical acceptance test of our semantics, see [Note: ignored parameters] in
prepare/ignore.py), against plain torch on each rank's own copy of the model: the non-ignored
weight trains as data parallel SGD over both ranks' batches (mean of the local gradients; fp32,
2 ranks: bit-exact), the ignored weight keeps each rank's own initial value, gets exactly each
rank's local gradient, is left alone by the ZeRO optimizer and is stepped by the user's own
optimizer exactly as a plain torch loop steps it; the state dict holds it as each rank has it;
and a ZeRO optimizer given the ignored weight is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise import ColoDDP, GeminiDDP, ZeroDDP, zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import run_ranks

CPU = torch.device("cpu")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 3, bias=False)
        self.fc2 = torch.nn.Linear(3, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def _gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


def _zero_ddp(module: torch.nn.Module) -> GeminiDDP:
    # One chunk per rank's share of a handful of elements: the chunk is sharded over 2 ranks.
    return zero_model_wrapper(module, 3, {"device": CPU, "chunk_size_numel": 16})  # type: ignore[return-value]


def _original() -> dict[str, bool]:
    results = {}
    for name, ddp_cls, init in (("colo", ColoDDP, ColoDDP), ("zero", ZeroDDP, _zero_ddp)):
        torch.manual_seed(dist.get_rank())  # set_seed(rank): each rank builds its own values
        model = Net()
        w1, w2 = model.fc1.weight, model.fc2.weight
        plain = Net()
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():  # the wrapper starts w1 from rank 0's values
            plain.fc1.weight.copy_(_gathered(w1.detach())[0])
        ddp_cls.set_params_to_ignore([w2])
        ddp = init(model)
        x = torch.rand(2, 3)
        loss = torch.sum(ddp(x))
        ddp.backward(loss)
        if ddp_cls is ZeroDDP:
            assert isinstance(ddp, GeminiDDP)
            chunk, index = ddp.chunk_manager.locate(w1)
            info = chunk.tensors[index]
            whole = torch.cat(_gathered(chunk.grads.shard))  # every rank's shard, in rank order
            w1s_grad = whole[info.offset : info.offset + info.numel].view(info.shape)
        else:
            assert w1.grad is not None
            w1s_grad = w1.grad
        w1_grads = _gathered(w1s_grad)
        assert w2.grad is not None
        w2_grads = _gathered(w2.grad)
        results[f"{name}: w1 grads equal"] = torch.equal(w1_grads[0], w1_grads[1])
        results[f"{name}: w2 grads differ"] = not torch.equal(w2_grads[0], w2_grads[1])
        plain(x).sum().backward()
        assert plain.fc1.weight.grad is not None
        local = _gathered(plain.fc1.weight.grad)
        expected = (local[0] + local[1]) / 2
        results[f"{name}: w1 grad is the data-parallel one"] = torch.equal(w1s_grad, expected)
    return results


def test_ddp_ignore_params() -> None:
    for result in run_ranks(_original, 2):
        assert all(result.values()), result


def _against_plain_torch() -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = Net()
    plain = Net()
    plain.load_state_dict(model.state_dict())
    # Every rank starts the data-parallel weight from rank 0's values, as the wrapper does.
    shared_init = _gathered(model.fc1.weight.detach())[0]
    with torch.no_grad():
        plain.fc1.weight.copy_(shared_init)
    initial_w2 = model.fc2.weight.detach().clone()

    GeminiDDP.set_params_to_ignore([model.fc2.weight])
    ddp = _zero_ddp(model)
    # The optimizer of the ZeRO parameters over the others, one of the user's own for w2.
    zero_optim = zero_optim_wrapper(ddp, torch.optim.SGD([model.fc1.weight], lr=0.5))
    own_optim = torch.optim.SGD([model.fc2.weight], lr=0.5)
    plain_w1_optim = torch.optim.SGD([plain.fc1.weight], lr=0.5)
    plain_w2_optim = torch.optim.SGD([plain.fc2.weight], lr=0.5)
    checks: dict[str, object] = {"w2 kept its own initial value": True}
    for step in range(3):
        torch.manual_seed(100 + 10 * step + rank)
        x = torch.rand(2, 3)
        zero_optim.zero_grad()
        own_optim.zero_grad()
        zero_optim.backward(ddp(x).sum())
        w2_grad = model.fc2.weight.grad
        assert w2_grad is not None
        # The plain reference: local backward, then w1's gradient averaged over the ranks.
        plain_w1_optim.zero_grad()
        plain_w2_optim.zero_grad()
        plain(x).sum().backward()
        assert plain.fc1.weight.grad is not None and plain.fc2.weight.grad is not None
        local = _gathered(plain.fc1.weight.grad)
        plain.fc1.weight.grad = (local[0] + local[1]) / world
        checks[f"step {step}: w2 grad is the local one"] = torch.equal(
            w2_grad, plain.fc2.weight.grad
        )
        before = model.fc2.weight.detach().clone()
        zero_optim.step()
        checks[f"step {step}: the ZeRO step leaves w2 alone"] = torch.equal(
            model.fc2.weight, before
        )
        if step == 0:
            checks["w2 kept its own initial value"] = torch.equal(before, initial_w2)
        own_optim.step()
        plain_w1_optim.step()
        plain_w2_optim.step()
    state = ddp.state_dict(only_rank_0=False)
    checks["w1 trains as data parallel SGD"] = torch.equal(state["fc1.weight"], plain.fc1.weight)
    checks["w2 trains as each rank's own SGD"] = torch.equal(state["fc2.weight"], plain.fc2.weight)
    checks["w2 differs between ranks"] = not torch.equal(*_gathered(state["fc2.weight"]))

    # A ZeRO optimizer over every parameter is refused: it cannot step the ignored one.
    torch.manual_seed(0)
    other = Net()
    GeminiDDP.set_params_to_ignore([other.fc2.weight])
    wrapped = _zero_ddp(other)
    with pytest.raises(ValueError, match="set_params_to_ignore") as refused:
        zero_optim_wrapper(wrapped, torch.optim.SGD(other.parameters(), lr=0.1))
    checks["refusal"] = str(refused.value)
    return checks


def test_ignored_parameters_against_plain_torch() -> None:
    for checks in run_ranks(_against_plain_torch, 2):
        refusal = checks.pop("refusal")
        assert "(1, 3)" in str(refusal)  # names the ignored weight's shape
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, failed
