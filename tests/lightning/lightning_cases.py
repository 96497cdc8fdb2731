"""A small LightningModule and the per-rank runs the Lightning tests compare.

Every run happens inside ranks forked by `shardwise.testing.run_ranks`: the rank already has
RANK, LOCAL_RANK and WORLD_SIZE in its environment and an initialised gloo process group, which
is what Lightning sees under torchrun. Its LightningEnvironment then reports an external
launcher (LOCAL_RANK is set), so the Trainer neither relaunches the command nor spawns, and
`_init_dist_connection` keeps the existing process group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise_lightning  # noqa: F401  (registers the strategy names)
from shardwise_lightning.base import ShardwiseStrategyBase

NUM_SAMPLES = 64
GLOBAL_BATCH = 8
IN, HIDDEN, OUT = 16, 32, 4


def dataset(seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_SAMPLES, IN, generator=generator)
    y = torch.randn(NUM_SAMPLES, OUT, generator=generator)
    return TensorDataset(x, y)


class Net(pl.LightningModule):
    """An MLP regression; built in __init__, or in configure_model with `build_late`; with
    `compiled`, `torch.compile`d in configure_model (aot_eager, see tests/test_compile.py)."""

    def __init__(
        self, build_late: bool = False, optimizer: str = "adamw", compiled: bool = False
    ) -> None:
        super().__init__()
        self.build_late = build_late
        self.compiled = compiled
        self.optimizer_name = optimizer
        self.net: nn.Module | None = None if build_late else _mlp()
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.test_losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = _mlp()
        if self.compiled and not isinstance(self.net, torch._dynamo.eval_frame.OptimizedModule):
            self.net = torch.compile(self.net, backend="aot_eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(x)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.losses.append(float(loss.detach().float()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.test_losses.append(float(loss))
        self.log("test_loss", loss, sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(
                self.parameters(), lr=0.05, momentum=0.9
            )
        elif self.optimizer_name == "adamw_by_shape":
            # nanoGPT's configure_optimizers: matrices decay, vectors do not. Lightning calls
            # this after the strategy sharded the module, so it reads wrapped shapes.
            matrices = [p for p in self.parameters() if p.dim() >= 2]
            vectors = [p for p in self.parameters() if p.dim() < 2]
            assert matrices and vectors
            optimizer = torch.optim.AdamW(
                [
                    {"params": matrices, "weight_decay": 0.1},
                    {"params": vectors, "weight_decay": 0.0},
                ],
                lr=1e-2,
            )
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler}}

    def _loader(self) -> DataLoader[Any]:
        world = self.trainer.world_size
        return DataLoader(dataset(), batch_size=GLOBAL_BATCH // world, shuffle=False)

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader()

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader()

    def test_dataloader(self) -> DataLoader[Any]:
        return self._loader()

    def predict_dataloader(self) -> DataLoader[Any]:
        return self._loader()


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, OUT),
    )


@dataclass
class FitResult:
    """What one rank saw in one fit."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    val_losses: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    # The engine's collective counts, where the strategy wrapped the module in one.
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    # The LightningModule's own state_dict() after fit, read without any collective.
    module_state: dict[str, torch.Tensor] = field(default_factory=dict)


def trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer over all ranks of the current group."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": dist.get_world_size(),
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "max_epochs": 1,
    }
    settings.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pl.Trainer(strategy=strategy, **settings)


def full_state(trainer_: pl.Trainer, module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """The whole model state on every rank, whichever strategy trained it."""
    strategy = trainer_.strategy
    if isinstance(strategy, ShardwiseStrategyBase):
        if strategy.state_dict_type == "full":
            return strategy.lightning_module_state_dict(rank_zero_only=False)
        # "sharded" gives this rank's shards there, as FSDPStrategy does; the engine's own
        # state_dict is the whole state.
        assert strategy.zero_model is not None
        return strategy.zero_model.state_dict(only_rank_0=False)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def fit(
    strategy: Any,
    make: Callable[[], Net] = Net,
    ckpt_path: str | Path | None = None,
    **kwargs: Any,
) -> FitResult:
    """Seed, build with `make`, fit; return this rank's losses and the final state."""
    pl.seed_everything(0, verbose=False)
    module = make()
    run = trainer(strategy, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(module, ckpt_path=ckpt_path)
    metrics = {k: float(v) for k, v in run.callback_metrics.items()}
    stats = getattr(run.strategy.model, "comm_stats", None)
    comm = stats.snapshot() if stats is not None else {}
    own = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return FitResult(module.losses, full_state(run, module), module.val_losses, metrics, comm, own)
