"""Reference training and sharded training on the same seed and global batch.

The reference is one process that computes each rank's slice of the global batch separately
and averages the slices' gradients, which is the data-parallel computation written out; with 2
ranks every sum it does has the same operands as the engine's (a + b is commutative), so fp32
results can be compared bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise import MixedPrecision, zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import GPT, GPTConfig, gpt_batch

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32)
GLOBAL_BATCH = 8
SEQ = 8
CHUNK_NUMEL = 3001  # several chunks, none a multiple of the world size: padding is exercised


class BranchyGPT(nn.Module):
    """A GPT plus a branch that runs always, never, or only for batches whose first token is
    even ("some_ranks": on the first half of the ranks, see `batch_slice`), and optionally a
    frozen layer. Stage 3 refuses a module that runs on some ranks only outside its gather
    units (see [Note: conditional units] in runtime/gather_units.py)."""

    def __init__(self, branch: str = "never", frozen: bool = False) -> None:
        super().__init__()
        self.gpt = GPT(CONFIG)
        self.branch = nn.Linear(CONFIG.vocab_size, CONFIG.vocab_size)
        self.mode = branch
        self.frozen = nn.Linear(CONFIG.vocab_size, CONFIG.vocab_size) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, _ = self.gpt(idx)
        if self.frozen is not None:
            logits = self.frozen(logits)
        if self.mode == "always" or (self.mode == "some_ranks" and int(idx[0, 0]) % 2 == 0):
            logits = logits + self.branch(logits)
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )


def make_model(branch: str = "never", frozen: bool = False) -> BranchyGPT:
    torch.manual_seed(0)
    return BranchyGPT(branch, frozen)


def batch_slice(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, targets = gpt_batch(CONFIG, GLOBAL_BATCH, SEQ, step * 100 + micro)
    # Make the branch decision differ between slices, whatever the world size (the global
    # batch must not depend on it): the first half of the batch starts with token 0, the
    # second with 1, so at 2 ranks rank 0 takes the branch and rank 1 skips it, at 4 ranks
    # ranks 0-1 take it and 2-3 skip it.
    idx[:, 0] = torch.arange(GLOBAL_BATCH) // (GLOBAL_BATCH // 2)
    return idx.chunk(world)[rank], targets.chunk(world)[rank]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@dataclass
class Run:
    """One training run's settings, shared by the reference and the sharded run."""

    stage: int = 2
    world: int = 2
    steps: int = 4
    accum: int = 1
    max_norm: float = 0.0
    norm_type: float = 2.0
    branch: str = "never"
    frozen: bool = False
    no_sync: bool = False
    overlap: bool = False
    reduction: str = "auto"  # gradient_reduction
    param_gather: bool = False  # overlap_param_gather (stages 1-2)
    optim: Callable[[Any], torch.optim.Optimizer] = adamw
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)


def reference(run: Run) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Unsharded training: each rank's slice in turn, gradients averaged over slices."""
    model = make_model(run.branch, run.frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = run.optim(params)
    losses = []
    for step in range(run.steps):
        total_grads = [torch.zeros_like(p) for p in params]
        reached = [False] * len(params)  # as DDP: a gradient on any rank's slice
        step_loss = torch.zeros(())
        rank_losses = []
        for rank in range(run.world):
            rank_loss = torch.zeros(())
            for micro in range(run.accum):
                model.zero_grad()
                loss = model(*batch_slice(step, micro, rank, run.world)) / run.accum
                loss.backward()
                rank_loss += loss.detach()
                for i, (total, p) in enumerate(zip(total_grads, params, strict=True)):
                    if p.grad is not None:
                        total.add_(p.grad)
                        reached[i] = True
            rank_losses.append(rank_loss)
        for loss in rank_losses:
            step_loss += loss
        for p, total, got in zip(params, total_grads, reached, strict=True):
            # A parameter no slice's gradient reached keeps .grad None, as after zero_grad()
            # in a torch loop: the optimizer leaves it (and its state) alone.
            p.grad = total / run.world if got else None
        if run.max_norm:
            torch.nn.utils.clip_grad_norm_(params, run.max_norm, run.norm_type)
        optimizer.step()
        losses.append(float(step_loss / run.world))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def sharded(run: Run) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    """The same training on this rank under shardwise (call inside run_ranks)."""
    rank = dist.get_rank()
    model = make_model(run.branch, run.frozen)
    config: dict[str, Any] = {
        "device": torch.device("cpu"),
        "mixed_precision": run.mixed_precision,
        "gradient_reduction": run.reduction,
    }
    optim_config = None
    if run.stage == 3:
        config["chunk_size_numel"] = CHUNK_NUMEL
    else:
        optim_config = {
            "reduce_bucket_size": CHUNK_NUMEL,
            "overlap_communication": run.overlap,
            "overlap_param_gather": run.param_gather,
        }
    wrapped = zero_model_wrapper(model, run.stage, config)
    optimizer = zero_optim_wrapper(
        wrapped,
        run.optim([p for p in model.parameters() if p.requires_grad]),
        max_norm=run.max_norm,
        norm_type=run.norm_type,
        optim_config=optim_config,
    )
    losses = []
    for step in range(run.steps):
        optimizer.zero_grad()
        step_loss = torch.zeros(())
        for micro in range(run.accum):
            loss = wrapped(*batch_slice(step, micro, rank, run.world)) / run.accum
            if run.no_sync and micro < run.accum - 1:
                with wrapped.no_sync():
                    optimizer.backward(loss)
            else:
                optimizer.backward(loss)
            step_loss += loss.detach().float()
        dist.all_reduce(step_loss)
        optimizer.step()
        losses.append(float(step_loss / run.world))
    info = {"scale": optimizer.loss_scale, "norm": optimizer.last_grad_norm}
    return losses, wrapped.state_dict(only_rank_0=False), info


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


class OkResponse:
    """What `urllib.request.urlopen` returns for a 200 with an empty JSON body, for tests that
    stand in for a dashboard."""

    def __enter__(self) -> OkResponse:
        return self

    def __exit__(self, *args: object) -> None:
        pass

    def read(self) -> bytes:
        return b"{}"


# A small net with a branch a forward may skip, and this rank's rows of a step's global batch:
# the models of the hybrid sharding and hpZ tests.
BRANCH_WIDTH = 24
ROWS_PER_RANK = 4


class BranchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        width = BRANCH_WIDTH
        self.inp = nn.Linear(width, 2 * width)
        self.mid = nn.Linear(2 * width, 2 * width)
        self.branch = nn.Linear(2 * width, 2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.mid(h))
        if use_branch:
            h = h + self.branch(h)
        return self.out(h)


def branch_net_batch(step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows (or `rank`'s) of step `step`'s global batch for `BranchNet`."""
    world = dist.get_world_size()
    rank = dist.get_rank() if rank is None else rank
    generator = torch.Generator().manual_seed(10 + step)
    x = torch.randn(world * ROWS_PER_RANK, BRANCH_WIDTH, generator=generator)
    y = torch.randn(world * ROWS_PER_RANK, BRANCH_WIDTH, generator=generator)
    part = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return x[part], y[part]


def branch_net_ddp(
    steps: int, use_branch: Callable[[int], bool], max_norm: float
) -> dict[str, torch.Tensor]:
    """The plain loop a user runs without shardwise on `BranchNet`: DDP with
    `find_unused_parameters=True`, `zero_grad()`, `backward()`, `clip_grad_norm_`, AdamW; the
    weights after `steps` steps."""
    torch.manual_seed(0)
    model = BranchNet()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        x, y = branch_net_batch(step)
        optimizer.zero_grad()
        (ddp(x, use_branch(step)) - y).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return model.state_dict()


# Relative slack for fp32's rounding of x / scale and q * scale in the blockwise formats.
FP32_SLACK = 1e-6
# Half a step of the integer formats, as a fraction of the block's absmax.
HALF_STEP = {"int8": 1 / 254, "int4": 1 / 14}


def round_trip_bound(kind: str, x: torch.Tensor, block: int) -> torch.Tensor:
    """Per value, the largest round-trip error the blockwise format `kind` ("int8", "int4"
    or "fp8") allows for `x` (flat, fp32) in blocks of `block` values: [Note: blockwise
    quantization] in shardwise/comm/quantize.py."""
    padded = torch.zeros(-(-x.numel() // block) * block)
    padded[: x.numel()] = x.abs()
    absmax = padded.view(-1, block).amax(dim=1).repeat_interleave(block)[: x.numel()]
    if kind in HALF_STEP:
        bound = absmax * HALF_STEP[kind]
    else:
        scale = absmax / 448
        bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    return bound + absmax * FP32_SLACK


def logged_messages(logger_name: str) -> list[str]:
    """A list that collects, from now on, every message the logger `logger_name` logs at INFO
    and above (in this process: call it inside the rank)."""
    import logging

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return messages
