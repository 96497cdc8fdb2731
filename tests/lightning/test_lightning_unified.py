"""The strategies under the unified `lightning` package (`import lightning as L`).

`shardwise_lightning.unified` builds the package's own source a second time on
`lightning.pytorch` (see [Note: two Lightning namespaces] there); the runs here load
lightning_cases.py the same way, so `Net`, `trainer` and `fit` are the very helpers of the
`pytorch_lightning` tests built on `lightning.pytorch`. Both namespaces run the same code on the
same seed, data and global batch, so a fit under `L.Trainer` must equal the fit under
`pl.Trainer` bit for bit, losses and final weights.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import lightning_cases
import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist

import shardwise_lightning
from shardwise.testing import run_ranks
from shardwise_lightning import unified


def _unified_cases() -> Any:
    """lightning_cases.py built on lightning.pytorch, as a module of its own."""
    name = "lightning_cases_unified"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(lightning_cases.__file__)
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    source = unified.rewrite_imports(path.read_text())
    exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)
    return module


unified_cases = _unified_cases()


def test_unified_classes_are_built_on_lightning_only() -> None:
    assert issubclass(unified_cases.Net, L.LightningModule)
    assert not issubclass(unified_cases.Net, pl.LightningModule)
    expected = {
        "GeminiStrategy": L.pytorch.strategies.Strategy,
        "FullyShardedStrategy": L.pytorch.strategies.Strategy,
        "ShardwisePrecision": L.pytorch.plugins.precision.Precision,
        "StreamingCheckpointIO": L.fabric.plugins.CheckpointIO,
    }
    for name, base in expected.items():
        ours, theirs = getattr(unified, name), getattr(shardwise_lightning, name)
        assert issubclass(ours, base) and not issubclass(theirs, base), name
        modules = [cls.__module__ for cls in ours.__mro__]
        assert not [m for m in modules if m.startswith(("pytorch_lightning", "lightning_fabric"))]
        assert not [
            m for m in modules if m.startswith("shardwise_lightning.") and ".unified." not in m
        ]
    # Each namespace's registry holds its own build under the same names.
    names = shardwise_lightning.STRATEGY_NAMES
    assert names == unified.STRATEGY_NAMES and "shardwise_gemini" in names
    for name in names:
        ours = L.pytorch.strategies.StrategyRegistry[name]["strategy"]
        theirs = pl.strategies.StrategyRegistry[name]["strategy"]
        assert ours.__module__.startswith("shardwise_lightning.unified."), name
        assert not theirs.__module__.startswith("shardwise_lightning.unified."), name
        assert ours.__name__ == theirs.__name__


def test_registered_name_and_plugins_with_lightning_trainer() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = L.Trainer(
            strategy="shardwise_gemini_offload",
            accelerator="cpu",
            devices=1,
            precision="bf16-mixed",
            logger=False,
        )
    assert type(run.strategy) is unified.GeminiStrategy
    entry = L.pytorch.strategies.StrategyRegistry["shardwise_gemini_offload"]
    assert (
        entry["init_params"]
        == pl.strategies.StrategyRegistry["shardwise_gemini_offload"]["init_params"]
    )
    assert isinstance(run.strategy.precision_plugin, unified.ShardwisePrecision)
    assert run.strategy.precision_plugin.precision == "bf16-mixed"
    assert isinstance(run.strategy.checkpoint_io, unified.StreamingCheckpointIO)


def test_other_namespace_is_refused_with_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"pytorch_lightning.*shardwise_lightning\.unified\.GeminiStrategy"
    ):
        L.Trainer(strategy=shardwise_lightning.GeminiStrategy(), accelerator="cpu", devices=1)
    with pytest.raises(
        ValueError, match=r"lightning\.pytorch.*shardwise_lightning\.FullyShardedStrategy"
    ):
        pl.Trainer(strategy=unified.FullyShardedStrategy(), accelerator="cpu", devices=1)
    with pytest.raises(TypeError, match=r"built on lightning\.pytorch.*built on pytorch_lightning"):
        unified.GeminiStrategy(precision_plugin=shardwise_lightning.ShardwisePrecision())
    with pytest.raises(TypeError, match=r"checkpoint_io.*shardwise_lightning\.unified"):
        shardwise_lightning.FullyShardedStrategy(checkpoint_io=unified.StreamingCheckpointIO())
    with pytest.raises(TypeError, match=r"accelerator.*built on lightning\.pytorch"):
        shardwise_lightning.GeminiStrategy(accelerator=L.pytorch.accelerators.CPUAccelerator())
    # pl's precision plugin handed to the unified strategy by the Trainer's setter path.
    strategy = unified.GeminiStrategy()
    with pytest.raises(TypeError, match="pytorch_lightning"):
        strategy.precision_plugin = pl.plugins.precision.MixedPrecision("bf16-mixed", "cpu")


def _summary(result: Any) -> dict[str, Any]:
    return {"losses": result.losses, "state": result.state, "module_state": result.module_state}


def _fits() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Per case: (pytorch_lightning, lightning) on this rank."""
    cases: dict[str, tuple[Any, Any]] = {
        "gemini": (
            lambda: shardwise_lightning.GeminiStrategy(placement_policy="cuda", chunk_size=500),
            lambda: unified.GeminiStrategy(placement_policy="cuda", chunk_size=500),
        ),
        "fsdp": (
            lambda: shardwise_lightning.FullyShardedStrategy(min_num_params=700),
            lambda: unified.FullyShardedStrategy(min_num_params=700),
        ),
        "registered_gemini": (lambda: "shardwise_gemini", lambda: "shardwise_gemini"),
    }
    results = {}
    for name, (make_pl, make_unified) in cases.items():
        ours = lightning_cases.fit(make_pl(), max_epochs=2)
        theirs = unified_cases.fit(make_unified(), max_epochs=2)
        results[name] = (_summary(ours), _summary(theirs))
    return results


def test_lightning_fit_matches_pytorch_lightning_fit_bit_for_bit() -> None:
    for rank, results in enumerate(run_ranks(_fits, 2, timeout_s=180)):
        for name, (classic, unified_run) in results.items():
            assert len(classic["losses"]) == 16, (rank, name)
            assert unified_run["losses"] == classic["losses"], (rank, name)
            for key in ("state", "module_state"):
                a, b = classic[key], unified_run[key]
                assert a.keys() == b.keys() and a, (rank, name, key)
                assert all(torch.equal(a[k], b[k]) for k in a), (rank, name, key)


def _checkpoint_round_trip(directory: Path) -> dict[str, Any]:
    """Fit one epoch under L.Trainer, save through it, resume a second epoch from the file
    (and load the weights into a fresh module); compare with two uninterrupted epochs."""

    def gemini() -> Any:
        return unified.GeminiStrategy(placement_policy="cuda", chunk_size=500)

    continuous = unified_cases.fit(gemini(), max_epochs=2)
    L.seed_everything(0, verbose=False)
    module = unified_cases.Net()
    first = unified_cases.trainer(gemini(), max_epochs=1)
    first.fit(module)
    path = directory / "epoch1.ckpt"
    first.save_checkpoint(path)
    saved = unified_cases.full_state(first, module)
    dist.barrier()
    loaded = unified_cases.Net.load_from_checkpoint(path, map_location="cpu").state_dict()
    resumed = unified_cases.fit(gemini(), max_epochs=2, ckpt_path=path)
    return {
        "continuous": _summary(continuous),
        "resumed": _summary(resumed),
        "saved": saved,
        "loaded": loaded,
        "checkpoint_io": type(first.strategy.checkpoint_io).__module__,
    }


def test_checkpoint_round_trips_through_lightning_trainer(tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(_checkpoint_round_trip, 2, tmp_path, timeout_s=180)):
        assert result["checkpoint_io"] == "shardwise_lightning.unified.checkpoint_io"
        saved, loaded = result["saved"], result["loaded"]
        assert saved.keys() == loaded.keys() and saved, rank
        assert all(torch.equal(saved[k], loaded[k]) for k in saved), rank
        continuous, resumed = result["continuous"], result["resumed"]
        # The resumed run trained only the second epoch, exactly as the continuous one did.
        assert resumed["losses"] == continuous["losses"][8:], rank
        assert all(torch.equal(continuous["state"][k], resumed["state"][k]) for k in saved), rank
