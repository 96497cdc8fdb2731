"""What ColossalAI accepts, accepted with its meaning (issue 38, part 1):

- Shardformer's flags on GeminiPlugin at `tp_size=1` (ColossalAI applies them only through its
  tensor-parallel sharding): accepted, the engine configuration unchanged, each logged once;
- `strict_ddp_mode=True` (GeminiPlugin, `gemini_config`, GeminiDDP): every parameter kept
  replicated (every chunk gathered, no gather in forward), training bit for bit as the plain
  torch loop (helpers.reference);
- `Booster(mixed_precision="fp16" | "bf16")` with TorchDDPPlugin: torch autocast (and for
  fp16 a `torch.amp.GradScaler`), bit for bit as the same DDP loop written with autocast and
  the scaler by hand;
- what ColossalAI ignores with a warning (`offload_param_frac` while chunks stay gathered, the
  "static" fractions under another policy, `Booster(device=...)`, `mixed_precision` beside a
  plugin that sets the precision) warns and is ignored here too;
- what is still refused names what to use instead;
- GeminiPlugin's boosted optimizer is a `GeminiOptimizer`, as ColossalAI's is.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import CHUNK_NUMEL, Run, adamw, batch_slice, make_model, max_abs_diff, reference
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise import CommOp, zero_model_wrapper, zero_optim_wrapper
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, TorchDDPPlugin
from shardwise.engine.model import ZeroModel
from shardwise.gemini import StaticPlacement
from shardwise.testing import run_ranks
from shardwise.zero import GeminiDDP, GeminiOptimizer

SHARDFORMER_FLAGS = (
    "enable_all_optimization",
    "enable_fused_normalization",
    "enable_flash_attention",
    "enable_sequence_parallelism",
    "enable_jit_fused",
)


def _warned(match: str, build: Any) -> Any:
    with pytest.warns(UserWarning, match=match):
        return build()


def _accepted_and_refused() -> dict[str, Any]:
    seen: dict[str, Any] = {}
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("shardwise.booster.plugin.shardformer_flags")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    flagged = [GeminiPlugin(**dict.fromkeys(SHARDFORMER_FLAGS, True)) for _ in range(2)]
    seen["flags_change_nothing"] = all(
        p.engine_config() == GeminiPlugin().engine_config() for p in flagged
    )
    seen["logged_once_each"] = sorted(
        flag for flag in SHARDFORMER_FLAGS for r in records if flag in r.getMessage()
    )
    logger.removeHandler(handler)

    half = _warned(
        "offload_param_frac=0.5 is ignored",
        lambda: GeminiPlugin(shard_param_frac=0.5, offload_param_frac=0.5),
    )
    seen["offload_ignored"] = half.engine_config().placement.policy == StaticPlacement(
        shard_param_frac=0.5
    )
    _warned("apply to placement_policy='static' only", lambda: GeminiPlugin(
        placement_policy="auto", offload_optim_frac=0.5
    ))  # fmt: skip
    _warned("device='cuda'.* is ignored", lambda: Booster(device="cuda", plugin=GeminiPlugin()))
    booster = _warned(
        "mixed_precision='fp16'.* is ignored",
        lambda: Booster(mixed_precision="fp16", plugin=GeminiPlugin()),
    )
    seen["precision_left_to_plugin"] = booster.mixed_precision is None
    # ColossalAI's Gemini checkpoint IO asserts the boosted optimizer is a GeminiOptimizer.
    model = make_model()
    _, boosted, *_ = Booster(plugin=GeminiPlugin()).boost(model, adamw(model.parameters()))
    seen["gemini_optimizer"] = isinstance(boosted, GeminiOptimizer)

    refusals = {
        "tp_size": (lambda: GeminiPlugin(tp_size=2), "leave tp_size=1"),
        "fp8": (lambda: GeminiPlugin(use_fp8=True), "use precision 'bf16' or 'fp16'"),
        "apex": (
            lambda: Booster(mixed_precision="fp16_apex", plugin=TorchDDPPlugin()),
            "use 'fp16'",
        ),
        "auto_strict": (
            lambda: zero_model_wrapper(
                make_model(),
                3,
                {
                    "device": torch.device("cpu"),
                    "placement_policy": "auto",
                    "strict_ddp_mode": True,
                },
            ),
            "use placement_policy='static'",
        ),
        "extra_dp_group": (
            lambda: GeminiDDP(make_model(), extra_dp_group=dist.group.WORLD),
            r"GeminiPlugin\(extra_dp_size=...\)",
        ),
        "scatter_after_inference": (
            lambda: GeminiDDP(make_model(), scatter_after_inference=False),
            "leave it True",
        ),
    }
    for name, (build, fix) in refusals.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                build()
                seen[name] = "accepted"
            except ValueError as error:
                seen[name] = fix if re.search(fix, str(error)) else str(error)
    return seen


def test_what_colossalai_ignores_is_accepted_and_the_rest_names_its_fix() -> None:
    seen = run_ranks(_accepted_and_refused, 2)[0]
    assert seen.pop("flags_change_nothing") is True
    assert seen.pop("logged_once_each") == sorted(SHARDFORMER_FLAGS)
    assert seen.pop("offload_ignored") is True
    assert seen.pop("precision_left_to_plugin") is True
    assert seen.pop("gemini_optimizer") is True
    fixes = {
        "tp_size": "leave tp_size=1",
        "fp8": "use precision 'bf16' or 'fp16'",
        "apex": "use 'fp16'",
        "auto_strict": "use placement_policy='static'",
        "extra_dp_group": r"GeminiPlugin\(extra_dp_size=...\)",
        "scatter_after_inference": "leave it True",
    }
    assert seen == fixes


# ---- strict_ddp_mode -------------------------------------------------------------------------


def _strict(front: str) -> Any:
    model = make_model()
    if front == "plugin":
        booster = Booster(plugin=GeminiPlugin(precision="fp32", strict_ddp_mode=True))
        wrapped, optimizer, *_ = booster.boost(model, adamw(model.parameters()))
        return wrapped, optimizer, booster.backward
    if front == "gemini_config":
        config = {"device": torch.device("cpu"), "strict_ddp_mode": True}
        wrapped = zero_model_wrapper(model, 3, {**config, "chunk_size_numel": CHUNK_NUMEL})
    else:  # ColossalAI 0.5's GeminiDDP
        wrapped = GeminiDDP(model, strict_ddp_mode=True, mixed_precision=torch.float32)
    optimizer = zero_optim_wrapper(wrapped, adamw(model.parameters()))
    return wrapped, optimizer, lambda loss, opt: opt.backward(loss)


def _strict_runs(run: Run) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for front in ("plugin", "gemini_config", "gemini_ddp"):
        model, optimizer, backward = _strict(front)
        assert isinstance(model, ZeroModel)
        losses, gathers_in_forward = [], 0
        for step in range(run.steps):
            optimizer.zero_grad()
            before = model.comm_stats.calls(CommOp.ALL_GATHER)
            loss = model(*batch_slice(step, 0, rank, run.world))
            gathers_in_forward += model.comm_stats.calls(CommOp.ALL_GATHER) - before
            backward(loss, optimizer)
            optimizer.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total / run.world))
        out[front] = {
            "losses": losses,
            "state": {k: v.float() for k, v in model.state_dict(only_rank_0=False).items()},
            "gathered": all(c.keep_gathered for c in model.chunk_manager.chunks),
            "gathers_in_forward": gathers_in_forward,
        }
    return out


def test_strict_ddp_mode_keeps_parameters_replicated_and_trains_as_the_plain_loop() -> None:
    run = Run(steps=3)
    ref_losses, ref_state = reference(run)
    for outcome in run_ranks(_strict_runs, 2, run):
        for front, seen in outcome.items():
            assert seen["gathered"], front
            assert seen["gathers_in_forward"] == 0, front
            assert seen["losses"] == ref_losses, front
            assert max_abs_diff(seen["state"], ref_state) == 0.0, front


# ---- Booster(mixed_precision=...) with TorchDDPPlugin -----------------------------------------


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _amp_runs(dtype_name: str, clip: bool) -> tuple[list[float], list[float], bool]:
    """The boosted loop and the loop written by hand (DDP, autocast, GradScaler), same data."""
    rank = dist.get_rank()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    criterion = nn.CrossEntropyLoss()
    # By hand, as torch's AMP recipe writes it.
    plain = DistributedDataParallel(_net())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    # Boosted, as ColossalAI's resnet example writes it (`torch_ddp_fp16`).
    booster = Booster(plugin=TorchDDPPlugin(), mixed_precision=dtype_name)
    net = _net()
    model, optimizer, boosted_criterion, *_ = booster.boost(
        net, torch.optim.AdamW(net.parameters(), lr=1e-2), criterion=criterion
    )
    plain_losses, boosted_losses = [], []
    for _ in range(4):
        generator = torch.Generator().manual_seed(rank)  # one batch per rank, learnt
        x, y = (
            torch.randn(8, 16, generator=generator),
            torch.randint(0, 8, (8,), generator=generator),
        )
        with torch.autocast("cpu", dtype=dtype):
            loss = criterion(plain(x), y)
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(plain_opt)
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        scaler.step(plain_opt)
        scaler.update()
        plain_opt.zero_grad()
        plain_losses.append(float(loss))

        boosted_loss = boosted_criterion(model(x), y)
        booster.backward(boosted_loss, optimizer)
        if clip:
            optimizer.clip_grad_by_norm(0.5)
        optimizer.step()
        optimizer.zero_grad()
        boosted_losses.append(float(boosted_loss))
    same = all(
        torch.equal(a, b)
        for a, b in zip(plain.module.parameters(), model.unwrap().parameters(), strict=True)
    )
    return plain_losses, boosted_losses, same


@pytest.mark.parametrize(("dtype_name", "clip"), [("fp16", False), ("fp16", True), ("bf16", False)])
def test_torch_ddp_mixed_precision_is_autocast_with_a_grad_scaler(
    dtype_name: str, clip: bool
) -> None:
    for plain_losses, boosted_losses, same in run_ranks(_amp_runs, 2, dtype_name, clip):
        assert boosted_losses == plain_losses
        assert same
        assert plain_losses[-1] < plain_losses[0]
