"""A dropped model leaves nothing behind: built, trained two steps and dropped, round after round
in one process (a sweep, a notebook, a test suite), every front door frees its model, wrapper,
optimizer and chunks, the disk tier's files and its threads, with no call from the user, as
torch's DDP and FSDP2 do (see [Note: hooks hold the engine weakly] in runtime/grad_reducer.py).
The last step's output and loss stay alive meanwhile, as a user's loop leaves them in its
variables (the loss printed after the loop, a notebook's last value): their autograd graph
holds the engine's backward hooks, which must not hold the engine.
"""

from __future__ import annotations

import gc
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise import (
    ColoDDP,
    EngineConfig,
    GeminiDDP,
    HybridAdam,
    Placement,
    telemetry,
    zero_model_wrapper,
    zero_optim_wrapper,
)
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
from shardwise.chunk import ChunkManager
from shardwise.gemini import HostPlacement
from shardwise.testing import run_ranks
from shardwise.zero import (
    GeminiOptimizer,
    LowLevelZeroOptimizer,
    ShardedModelV2,
    ShardedOptimizerV2,
    TensorShardStrategy,
)

ROUNDS = 3


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


# The last step's output and loss of the round, kept while its objects are checked.
KEPT: list[torch.Tensor] = []


def _train(model: Any, optimizer: Any, backward: Callable[[torch.Tensor], None]) -> None:
    for step in range(2):
        generator = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        optimizer.zero_grad()
        output = model(torch.randn(8, 32, generator=generator))
        loss = output.square().mean()
        backward(loss)
        optimizer.step()
    KEPT[:] = [output, loss]


def _disk_adam(model: nn.Module, directory: str) -> HybridAdam:
    """HybridAdam with every optimizer side it is given in the disk tier's files."""
    return HybridAdam(
        model.parameters(), lr=1e-3, nvme_offload_fraction=1.0, nvme_offload_dir=directory
    )


def _zero(stage: int, directory: str, *, offload: bool = False) -> list[Any]:
    """Stage 1-3 through zero_model_wrapper; `offload`: optimizer state in host memory and,
    with HybridAdam's nvme_offload_fraction=1.0, in the disk tier's files."""
    model = _model()
    config: dict[str, Any] = {"device": torch.device("cpu")}
    if stage == 3:
        config.update(chunk_size_numel=1024, placement_policy="cpu" if offload else "cuda")
    wrapped = zero_model_wrapper(model, stage, config)
    inner = (
        HybridAdam(
            model.parameters(), lr=1e-3, nvme_offload_fraction=1.0, nvme_offload_dir=directory
        )
        if offload
        else torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    optim_config = {"cpu_offload": True} if offload and stage < 3 else None
    optimizer = zero_optim_wrapper(wrapped, inner, optim_config=optim_config)
    _train(wrapped, optimizer, optimizer.backward)
    return [model, wrapped, optimizer, inner]


def _with_telemetry(directory: str) -> list[Any]:
    """Stage 3 streaming telemetry to a file: its recorder, exit handler and exception hook
    must not keep the run alive, and the run is reported finished once it is dropped."""
    objects = _zero(3, directory)
    recorder = telemetry.enable(objects[1], objects[2], path=os.path.join(directory, "run"))
    return [*objects, recorder]


def _booster(plugin: Any, directory: str, *, disk: bool = False) -> list[Any]:
    model = _model()
    inner = _disk_adam(model, directory) if disk else HybridAdam(model.parameters(), lr=1e-3)
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, inner)
    _train(boosted, optimizer, lambda loss: booster.backward(loss, optimizer))
    return [model, boosted, optimizer, inner, booster]


def _wrapped(
    wrap: Callable[[nn.Module], Any], optimize: Callable[[Any, Any], Any]
) -> Callable[[str], list[Any]]:
    """A front door that wraps the model (`wrap`), then its optimizer (`optimize(inner,
    wrapped)`), HybridAdam's state on disk."""

    def build(directory: str) -> list[Any]:
        model = _model()
        wrapped = wrap(model)
        inner = _disk_adam(wrapped, directory)
        optimizer = optimize(inner, wrapped)
        _train(wrapped, optimizer, optimizer.backward)
        return [model, wrapped, optimizer, inner]

    return build


def _low_level_optimizer(directory: str) -> list[Any]:
    model = _model()
    inner = _disk_adam(model, directory)
    optimizer = LowLevelZeroOptimizer(inner, partition_grad=True, cpu_offload=True)
    _train(model, optimizer, optimizer.backward)
    return [model, optimizer, inner]


def _on_disk(directory: str) -> EngineConfig:
    """Stage 3, every optimizer side in the disk tier's files under `directory`."""
    placement = Placement(policy=HostPlacement(), disk_fraction=1.0, disk_dir=directory)
    return EngineConfig(stage=3, device=torch.device("cpu"), placement=placement)


def _lightning(directory: str) -> list[Any]:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from shardwise_lightning import GeminiStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.net(batch[0]).square().mean()
            KEPT[:] = [loss]
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = Module()
    strategy = GeminiStrategy(engine_config=_on_disk(directory))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(TensorDataset(torch.randn(16, 32)), batch_size=4))
    return [module, strategy, trainer]


def _hf_trainer(directory: str) -> list[Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from shardwise_hf import ShardwiseCallback

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    tokens = torch.arange(8 * 16).reshape(8, 16) % 64
    data = [{"input_ids": row, "labels": row} for row in tokens]
    args = TrainingArguments(
        output_dir=f"{directory}-trainer", max_steps=2, per_device_train_batch_size=2,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    callback = ShardwiseCallback(engine_config=_on_disk(directory))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    return [model, callback, trainer]


def _colo_ddp(directory: str) -> list[Any]:
    model = _model()
    wrapped = ColoDDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(wrapped, optimizer, lambda loss: wrapped.backward(loss))
    return [model, wrapped, optimizer]


FRONT_DOORS: dict[str, Callable[[str], list[Any]]] = {
    "stage 1": lambda d: _zero(1, d),
    "stage 2": lambda d: _zero(2, d),
    "stage 2, cpu_offload, state on disk": lambda d: _zero(2, d, offload=True),
    "stage 3": lambda d: _zero(3, d),
    "stage 3, cpu placement, state on disk": lambda d: _zero(3, d, offload=True),
    "stage 3, telemetry": _with_telemetry,
    "Booster(GeminiPlugin)": lambda d: _booster(GeminiPlugin(precision="fp32"), d),
    "Booster(LowLevelZeroPlugin)": lambda d: _booster(LowLevelZeroPlugin(stage=2), d),
    "Booster(GeminiPlugin), HybridAdam's state on disk": lambda d: _booster(
        GeminiPlugin(precision="fp32", placement_policy="cpu"), d, disk=True
    ),
    "Booster(LowLevelZeroPlugin), cpu_offload, HybridAdam's state on disk": lambda d: _booster(
        LowLevelZeroPlugin(stage=2, precision="fp32", cpu_offload=True), d, disk=True
    ),
    "GeminiDDP + GeminiOptimizer, state on disk": _wrapped(
        lambda m: GeminiDDP(m, placement_policy="cpu", mixed_precision=torch.float32),
        GeminiOptimizer,
    ),
    "ShardedModelV2 + ShardedOptimizerV2, state on disk": _wrapped(
        lambda m: ShardedModelV2(m, TensorShardStrategy(), offload_config={"device": "cpu"}),
        lambda inner, wrapped: ShardedOptimizerV2(wrapped, inner),
    ),
    "LowLevelZeroOptimizer, cpu_offload, state on disk": _low_level_optimizer,
    "Lightning GeminiStrategy, engine_config's disk tier": _lightning,
    "HF Trainer + ShardwiseCallback, engine_config's disk tier": _hf_trainer,
    "ColoDDP": _colo_ddp,
}


def _rounds(name: str, directory: str) -> dict[str, Any]:
    """ROUNDS rounds of one front door on this rank: what is still alive after each."""
    mine = os.path.join(directory, f"rank{dist.get_rank()}")
    os.makedirs(mine)
    threads_before = {t.ident for t in threading.enumerate()}
    alive, files = [], []
    finished = []
    for _ in range(ROUNDS):
        refs = [weakref.ref(obj) for obj in FRONT_DOORS[name](mine)]
        gc.collect()
        alive.append([type(r()).__name__ for r in refs if r() is not None])
        telemetry_file = Path(mine, f"run.rank{dist.get_rank()}.jsonl")
        if telemetry_file.exists():  # its own run each round, reported finished when dropped
            lines = telemetry_file.read_text().splitlines()
            finished.append(sum('"run_finished"' in line for line in lines))
            telemetry_file.unlink()
        files.append(sorted(str(p.relative_to(mine)) for p in Path(mine).rglob("*")))
        KEPT.clear()
    managers = sum(isinstance(obj, ChunkManager) for obj in gc.get_objects())
    threads = [t.name for t in threading.enumerate() if t.ident not in threads_before]
    return {
        "alive": alive, "files": files, "chunk_managers": managers, "threads": threads,
        "finished": finished,
    }  # fmt: skip


@pytest.mark.parametrize("name", list(FRONT_DOORS))
def test_a_dropped_model_frees_everything(name: str, tmp_path: Path) -> None:
    for seen in run_ranks(_rounds, 2, name, str(tmp_path)):
        assert seen["alive"] == [[]] * ROUNDS, seen
        assert seen["files"] == [[]] * ROUNDS, seen
        assert seen["chunk_managers"] == 0, seen
        assert seen["threads"] == [], seen
        assert seen["finished"] == ([1] * ROUNDS if "telemetry" in name else []), seen
