"""What both shardwise strategies share: wrapping, the optimizer, checkpoints, teardown.

A subclass only translates its own arguments into the core's `gemini_config`; this class
hands the LightningModule to `zero_model_wrapper(zero_stage=3)`, the optimizer from
`configure_optimizers` to `zero_optim_wrapper`, and Lightning's checkpoints to
`shardwise.checkpoint`. It leans on Lightning's public strategy hooks only.
"""

from __future__ import annotations

import shutil
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.model_helpers import is_overridden
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

from shardwise import (
    DynamicGradScaler,
    TensorShardStrategy,
    ZeroInitContext,
    ZeroModel,
    ZeroOptimizer,
    zero_model_wrapper,
    zero_optim_wrapper,
)
from shardwise import checkpoint as sharded_checkpoint
from shardwise_lightning.precision import ShardwisePrecision, as_shardwise_precision


class ShardwiseStrategyBase(DDPStrategy):
    """Base of the shardwise strategies (ZeRO stage 3 over the chunk engine).

    Args:
        loss_scale: the `DynamicGradScaler` settings (used when fp16 is involved).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout: as for Lightning's `DDPStrategy` (`checkpoint_io`
            reads plain Lightning checkpoints; shardwise checkpoints are written by the
            engine). Processes come from torchrun (or another external launcher) or from
            Lightning relaunching the script; spawn/fork launchers are not offered, since they
            copy weights back through the module's own, sharded, state_dict.
    """

    def __init__(
        self,
        *,
        loss_scale: Mapping[str, Any],
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        DynamicGradScaler(**loss_scale)  # validates the scaler settings now, not inside fit
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method="popen",
        )
        self._loss_scale = dict(loss_scale)
        self._zero_model: ZeroModel | None = None
        self._loaded_sharded = False

    # ---- what a subclass provides -------------------------------------------------------------

    def gemini_config(self, device: torch.device) -> dict[str, Any]:
        """The `gemini_config` for `zero_model_wrapper(zero_stage=3)` on `device`."""
        raise NotImplementedError

    def state_dict_device(self) -> torch.device:
        """Where `lightning_module_state_dict` puts its tensors."""
        return torch.device("cpu")

    # ---- precision ---------------------------------------------------------------------------

    @property  # type: ignore[override]
    def precision_plugin(self) -> ShardwisePrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, ShardwisePrecision) else ShardwisePrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning picks its own plugin from Trainer(precision=...); the engine owns dtypes.
        self._precision_plugin = as_shardwise_precision(plugin)

    # ---- properties of the seeds -------------------------------------------------------------

    @property
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning runs the accumulation loop; gradients of every backward accumulate
        in their shards and the engine steps once per `accumulate_grad_batches`."""
        return False

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: a checkpoint loads into the engine's shards, which exist after setup."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restores its optimizer in load_checkpoint

    @property
    def zero_model(self) -> ZeroModel | None:
        """The engine's wrapped LightningModule (after setup)."""
        return self._zero_model

    # ---- model creation ------------------------------------------------------------------------

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Modules built in `configure_model` keep only this rank's slice of each parameter
        (`ZeroInitContext`); every rank builds from rank 0's random state, so the values are
        those the same code gives unsharded."""
        states = _rank0_rng_states(self.root_device)
        context = ZeroInitContext(
            target_device=self.root_device, shard_strategy=TensorShardStrategy()
        )
        with context:
            _set_rng_states(states, self.root_device)  # after the context's own seeding
            yield

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Nothing to block: at stage 3 every backward reduces into the shards, which is how
        gradients accumulate without a full unsharded copy."""
        yield

    # ---- setup -------------------------------------------------------------------------------

    def setup(self, trainer: Trainer) -> None:
        """Wrap the LightningModule (and, when fitting, its optimizer) in the engine."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.lightning_module is not None
        _check_trainer(trainer, self.lightning_module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync and self._zero_model is None:
            self.model = self._layer_sync.apply(self.lightning_module)
        self.model = self._setup_model(self.lightning_module)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _setup_model(self, model: Module) -> Module:  # type: ignore[override]
        if self._zero_model is not None and self._zero_model.module is model:
            return self._zero_model  # a later fit/validate of the same, already sharded module
        self._zero_model = zero_model_wrapper(
            model, zero_stage=3, gemini_config=self.gemini_config(self.root_device)
        )
        return self._zero_model

    def setup_optimizers(self, trainer: Trainer) -> None:
        """The optimizer of `configure_optimizers`, wrapped to step sharded fp32 masters; LR
        schedulers keep driving the inner optimizer's parameter groups."""
        super().setup_optimizers(trainer)
        # Lightning stands a _MockOptimizer in for a configure_optimizers that returned None.
        optimizers = [o for o in self.optimizers if type(o).__name__ != "_MockOptimizer"]
        if len(optimizers) != 1:
            raise ValueError(
                f"shardwise strategies need exactly one optimizer from configure_optimizers, got "
                f"{len(optimizers)}; all parameters share one engine, so use parameter groups "
                f"instead of several optimizers"
            )
        optimizer = optimizers[0]
        if isinstance(optimizer, LBFGS):
            raise ValueError(
                "LBFGS needs the whole gradient and a closure; shardwise steps elementwise "
                "optimizers over shards (SGD, Adam, AdamW, HybridAdam, ...)"
            )
        assert self._zero_model is not None
        previous = self._zero_model.zero_optimizer
        if previous is not None:
            # A later fit of the same sharded module: its new optimizer replaces the old one.
            previous.close()
        clip = trainer.gradient_clip_val
        engine = zero_optim_wrapper(
            self._zero_model,
            optimizer,
            max_norm=float(clip or 0.0),
            norm_type=2.0,
            **self._loss_scale,
        )
        self.optimizers = [cast(Optimizer, engine)]

    def zero_optimizer(self) -> ZeroOptimizer | None:
        """The engine's optimizer (after setup for fitting)."""
        if not self.optimizers:
            return None
        inner = getattr(self.optimizers[0], "_optimizer", self.optimizers[0])
        return inner if isinstance(inner, ZeroOptimizer) else None

    # ---- state dicts and checkpoints -------------------------------------------------------------

    def lightning_module_state_dict(self, rank_zero_only: bool = False) -> dict[str, Any]:
        """The whole module state (fp32 master weights, buffers) with the LightningModule's
        names, detached, on CPU (or the compute device with `state_dict_to_cpu=False`). A
        collective; with `rank_zero_only` ranks other than 0 get an empty dict."""
        if self._zero_model is None:
            assert self.lightning_module is not None
            return self.lightning_module.state_dict()
        state = self._zero_model.state_dict(only_rank_0=rank_zero_only)
        device = self.state_dict_device()
        if device.type != "cpu":
            state = {
                k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()
            }
        return state

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        # This rank's shards only; save_checkpoint writes the engine's sharded checkpoint.
        engine = getattr(optimizer, "_optimizer", optimizer)
        return cast(dict[str, Any], engine.state_dict())

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write a shardwise checkpoint at `filepath` (every rank its shards; world-size
        independent): model and, unless weights only, optimizer and loss scaler from the
        engine, the rest of Lightning's checkpoint (loops, schedulers, callbacks) beside."""
        if storage_options is not None:
            raise TypeError(
                "save_checkpoint(storage_options=...) cannot be honoured: shardwise checkpoints "
                "are written by the engine, not through a CheckpointIO"
            )
        if self._zero_model is None:
            raise ValueError("nothing to save: the model is not set up by the strategy yet")
        path = self.broadcast(str(filepath))
        optimizer = self.zero_optimizer() if "optimizer_states" in checkpoint else None
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        sharded_checkpoint.save(path, self._zero_model, optimizer, extra=rest)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a shardwise checkpoint (from any world size) into the engine and return the
        rest of Lightning's checkpoint; a plain Lightning checkpoint file loads its weights."""
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.lightning_module is not None and self._zero_model is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if _is_shardwise_checkpoint(path):
            optimizer = self.zero_optimizer() if fitting else None
            extra = sharded_checkpoint.load(path, self._zero_model, optimizer)
            self._loaded_sharded = True
            return cast(dict[str, Any], extra)
        loaded = super().load_checkpoint(path, weights_only=weights_only)
        if fitting and loaded.get("optimizer_states"):
            raise ValueError(
                f"{path} is a plain Lightning checkpoint: its optimizer state cannot be "
                f"resumed into sharded optimizer state. Resume from a checkpoint saved with this "
                f"strategy, or load the weights in on_fit_start / with trainer.validate first"
            )
        self._loaded_sharded = False
        return loaded

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._loaded_sharded:
            return  # load_checkpoint already wrote the weights into the shards
        assert self._zero_model is not None
        self._zero_model.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # the engine restored it in load_checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a shardwise checkpoint (the link and the directory it names)."""
        if not self.is_global_zero:
            return
        path = Path(filepath)
        if path.is_symlink():
            target = path.resolve()
            path.unlink()
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
        else:
            super().remove_checkpoint(filepath)

    # ---- end -----------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Release the plugins; the module stays in the engine (its parameters live in the
        chunks), so a later validate/test/predict of the same Trainer reuses it."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


def _check_trainer(trainer: Trainer, module: LightningModule) -> None:
    """Refuse Trainer settings the engine cannot honour, before anything runs."""
    algorithm = trainer.gradient_clip_algorithm
    name = None if algorithm is None else str(getattr(algorithm, "value", algorithm))
    if trainer.gradient_clip_val and name not in (None, "norm"):  # None: Lightning's "norm"
        raise ValueError(
            f"gradient_clip_algorithm={name!r} cannot be honoured: the engine clips the global "
            f"gradient norm across shards; use gradient_clip_algorithm='norm'"
        )
    if is_overridden("configure_gradient_clipping", module):
        raise ValueError(
            "configure_gradient_clipping is overridden, but the engine clips inside its step "
            "(Trainer(gradient_clip_val=...) sets max_norm); remove the override"
        )
    if is_overridden("backward", module):
        raise ValueError(
            "LightningModule.backward is overridden, but the engine runs backward itself (loss "
            "scaling, gradients into chunks); remove the override"
        )


def _is_shardwise_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "manifest.json").is_file()


def _rank0_rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    if dist.is_initialized():
        dist.broadcast_object_list(states, src=0)
    return states


def _set_rng_states(states: list[torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
