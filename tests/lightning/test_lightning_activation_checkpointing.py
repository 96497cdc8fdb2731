"""Activation checkpointing inside a LightningModule under both shardwise strategies, against
Lightning's own `ddp` on the same 2 CPU ranks, seed and global batch.

The middle block of the MLP runs under `torch.utils.checkpoint`, reentrant and not. Its forward
is re-run during backward: at stage 3 the engine gathers the block's chunk again for that
recomputation (the gather hooks see a forward inside backward), and the recomputation is not a
new pass of the root module, so the ranks' pass counters stay in step. Recomputing gives the
same fp32 numbers as the first forward, so the runs are compared bit for bit, as the plain fits
are in test_lightning_parity.py.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import torch
from lightning_cases import FitResult, Net, fit
from torch.utils.checkpoint import checkpoint

from shardwise.testing import run_ranks
from shardwise_lightning import FullyShardedStrategy, GeminiStrategy


class CheckpointedNet(Net):
    """Net whose middle Linear+Tanh is recomputed in backward; counts the recomputations."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        hidden = self.net[1](self.net[0](x))  # (B, HIDDEN); requires grad, as reentrant needs
        hidden = checkpoint(self._block, hidden, use_reentrant=self.reentrant)
        return self.net[4](hidden)

    def _block(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        self.block_calls += 1
        return self.net[3](self.net[2](hidden))


def _build(built: list[CheckpointedNet], reentrant: bool) -> CheckpointedNet:
    built.append(CheckpointedNet(reentrant))
    return built[-1]


def _runs() -> dict[str, tuple[FitResult, int]]:
    out: dict[str, tuple[FitResult, int]] = {}
    out["plain_ddp"] = (fit("ddp"), 0)
    strategies: dict[str, Any] = {
        "ddp": lambda: "ddp",
        "gemini": lambda: GeminiStrategy(placement_policy="cuda", chunk_size=500),
        "fsdp": lambda: FullyShardedStrategy(min_num_params=700),
    }
    for reentrant in (False, True):
        for name, make in strategies.items():
            built: list[CheckpointedNet] = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = fit(make(), partial(_build, built, reentrant))
            kind = "reentrant" if reentrant else "non_reentrant"
            out[f"{name}_{kind}"] = (result, built[0].block_calls)
    return out


def test_activation_checkpointing_matches_ddp() -> None:
    for rank, runs in enumerate(run_ranks(_runs, 2, timeout_s=180)):
        plain, _ = runs.pop("plain_ddp")
        for kind in ("non_reentrant", "reentrant"):
            reference, calls = runs[f"ddp_{kind}"]
            # Checkpointing changes no number: ddp with it equals ddp without it.
            assert reference.losses == plain.losses, (rank, kind)
            steps = len(reference.losses)
            assert steps == 8
            # The block ran twice per step: forward and recomputation in backward.
            assert calls == 2 * steps, (rank, kind, calls)
            for strategy in ("gemini", "fsdp"):
                ours, our_calls = runs[f"{strategy}_{kind}"]
                assert our_calls == 2 * steps, (rank, strategy, kind, our_calls)
                assert ours.losses == reference.losses, (rank, strategy, kind)
                assert ours.state.keys() == reference.state.keys()
                for key, value in reference.state.items():
                    assert torch.equal(ours.state[key], value), (rank, strategy, kind, key)
        # The runs trained.
        assert sum(plain.losses[-3:]) < sum(plain.losses[:3])
