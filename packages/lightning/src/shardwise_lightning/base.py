"""What both shardwise strategies share: wrapping, the optimizer, checkpoint hooks, teardown.

A subclass only translates its own arguments into the engine's configuration
(`shardwise.EngineConfig`); this class hands the LightningModule to `wrap_model`, the optimizer
from `configure_optimizers` to `wrap_optimizer`, and Lightning's state-dict and checkpoint
hooks to its `Checkpoints` (checkpoints.py). It leans on Lightning's public strategy hooks only.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from pytorch_lightning import Trainer
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

from shardwise import (
    EngineConfig,
    TensorShardStrategy,
    ZeroInitContext,
    ZeroModel,
    ZeroOptimizer,
    telemetry,
)
from shardwise.amp import LossScaleConfig
from shardwise.comm.quantize import DEFAULT_QUANT_BLOCK_NUMEL
from shardwise.engine.module_at_rest import ModuleState
from shardwise.engine.optimizer import optimizer_of
from shardwise.engine.refine import Parts
from shardwise.engine.wrap import wrap_model, wrap_optimizer
from shardwise_lightning.checkpoint_io import StreamingCheckpointIO
from shardwise_lightning.checkpoint_paths import remove_sharded_checkpoint
from shardwise_lightning.checkpoints import STATE_DICT_TYPES, Checkpoints, StateDictType
from shardwise_lightning.engine_settings import strategy_settings
from shardwise_lightning.module_after_run import hand_back_whole_module, run_finished
from shardwise_lightning.namespace import check_namespaces, describe
from shardwise_lightning.precision import ShardwisePrecision, as_shardwise_precision
from shardwise_lightning.rank0_rng import rank0_rng_states, set_rng_states
from shardwise_lightning.trainer_checks import (
    check_all_managed,
    check_trainer,
    unmanaged_parameters,
)

# The state_dict_type names were defined here before checkpoints.py: still importable from here.
__all__ = ["STATE_DICT_TYPES", "ShardwiseStrategyBase", "StateDictType"]


class ShardwiseStrategyBase(DDPStrategy):
    """Base of the shardwise strategies (ZeRO stage 3 over the chunk engine).

    Args:
        loss_scale: the dynamic loss scale's settings (used when fp16 is involved).
        state_dict_type: what `trainer.save_checkpoint` (and so `ModelCheckpoint`) writes:
            "full" (the default, as for Lightning's FSDPStrategy: one `.ckpt` file from rank 0
            that `load_from_checkpoint`, `torch.load` and plain Lightning strategies read; see
            [Note: full checkpoints] in full_checkpoint.py) or "sharded" (a directory, every
            rank its shards, world-size independent, no rank holding the whole state). Either
            replaces a checkpoint of the other form under the same name.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout: as for Lightning's `DDPStrategy` (`checkpoint_io`
            reads and writes single-file checkpoints, by default a `StreamingCheckpointIO`;
            sharded ones are the engine's).
            Processes come from torchrun (or another external launcher) or from Lightning
            relaunching the script; spawn/fork launchers are not offered, since they
            copy weights back through the module's own, sharded, state_dict.
        shard_size, secondary_shard_size: hybrid sharding and ZeRO++ hpZ (see the
            subclasses).
        gather_format, reduce_format, quant_block_numel: the wire formats (see the
            subclasses and `shardwise.Communication`).
        engine_config: the engine's whole configuration (stage 3), which `asked` refines, or
            None (see `GeminiStrategy`).
        asked, defaults: the subclass's arguments, and its default arguments, translated into
            the engine's settings.
    """

    def __init__(
        self,
        *,
        loss_scale: LossScaleConfig,
        asked: Parts,
        defaults: Parts,
        engine_config: object = None,
        state_dict_type: str = "full",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        shard_size: int | None = None,
        secondary_shard_size: int | None = None,
        gather_format: str = "dtype",
        reduce_format: str = "dtype",
        quant_block_numel: int = DEFAULT_QUANT_BLOCK_NUMEL,
    ) -> None:
        # See [Note: two Lightning namespaces] in shardwise_lightning/unified.
        check_namespaces(
            type(self).__name__, accelerator=accelerator, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
        )  # fmt: skip
        # Refuses a wrong state_dict_type before Lightning's strategy is built.
        self._checkpoints = Checkpoints(state_dict_type)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            # See [Note: one write of a checkpoint file] in checkpoint_io.py.
            checkpoint_io=checkpoint_io if checkpoint_io is not None else StreamingCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method="popen",
        )
        if not isinstance(loss_scale, LossScaleConfig):
            raise TypeError(f"loss_scale must be a LossScaleConfig, got {loss_scale!r}")
        self._loss_scale = loss_scale
        self._settings = strategy_settings(
            type(self).__name__, engine_config, asked, defaults,
            shard_size=shard_size, secondary_shard_size=secondary_shard_size,
            gather_format=gather_format, reduce_format=reduce_format,
            quant_block_numel=quant_block_numel,
        )  # fmt: skip
        self._zero_model: ZeroModel | None = None
        # The fit's telemetry, when the environment says where (SHARDWISE_DASHBOARD_URL, ...):
        # reported finished at teardown.
        self._recorder: telemetry.TelemetryRecorder | None = None
        # Every module this strategy sharded, by id: one Trainer may fit one module, test
        # another and come back to the first, whose parameters already live in its engine.
        self._engines: dict[int, ZeroModel] = {}

    __repr__ = describe  # names the namespace (see [Note: two Lightning namespaces])

    # ---- what a subclass provides -------------------------------------------------------------

    def engine_config(self, device: torch.device) -> EngineConfig:
        """The engine's configuration on `device`, in the Trainer's precision: engine_config
        refined by the strategy's arguments (see [Note: engine_config and the arguments that
        refine it] in shardwise/engine/refine.py)."""
        plugin = self.precision_plugin
        return self._settings.on(device, plugin.dtype, plugin.precision)

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
    def state_dict_type(self) -> StateDictType:
        """What `save_checkpoint` writes: "full" or "sharded" (see the class's arguments)."""
        return self._checkpoints.state_dict_type

    @state_dict_type.setter
    def state_dict_type(self, state_dict_type: StateDictType) -> None:
        self._checkpoints.state_dict_type = state_dict_type

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
        states = rank0_rng_states(self.root_device)
        context = ZeroInitContext(
            target_device=self.root_device, shard_strategy=TensorShardStrategy()
        )
        with context:
            set_rng_states(states, self.root_device)  # after the context's own seeding
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
        check_trainer(trainer, self.lightning_module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync and self._zero_model is None:
            self.model = self._layer_sync.apply(self.lightning_module)
        self.model = self._setup_model(self.lightning_module)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _setup_model(self, model: Module) -> Module:  # type: ignore[override]
        engine = self._engines.get(id(model))
        if engine is not None and engine.module is model:
            # A later fit/validate/test of a module this strategy already sharded.
            self._zero_model = engine
            assert self.lightning_module is not None
            fn = self.lightning_module.trainer.state.fn
            self._check_all_managed(f"at the start of {getattr(fn, 'value', fn)}")
            if engine.module_state is ModuleState.WHOLE:
                # The values it holds now: see [Note: the module after a run] (module_after_run.py)
                engine.shard_module()
            return engine
        self._zero_model = wrap_model(model, self.engine_config(self.root_device))
        self._engines[id(model)] = self._zero_model
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
        previous = optimizer_of(self._zero_model)
        if previous is not None:
            # A later fit of the same sharded module: its new optimizer replaces the old one.
            previous.close()
        self._checkpoints.record_param_groups(self._zero_model.module, optimizer)
        clip = trainer.gradient_clip_val
        engine = wrap_optimizer(
            self._zero_model,
            optimizer,
            loss_scale=self._loss_scale,
            max_norm=float(clip or 0.0),
            norm_type=2.0,
        )
        front_door = f"Lightning {type(self).__name__}"  # named on the dashboard
        self._recorder = telemetry.enable(self._zero_model, engine, entry_point=front_door)
        self.optimizers = [cast(Optimizer, engine)]

    def zero_optimizer(self) -> ZeroOptimizer | None:
        """The engine's optimizer (after setup for fitting)."""
        if not self.optimizers:
            return None
        inner = getattr(self.optimizers[0], "_optimizer", self.optimizers[0])
        return inner if isinstance(inner, ZeroOptimizer) else None

    # ---- state dicts and checkpoints: Lightning's hooks, done by the Checkpoints -------------

    def lightning_module_state_dict(self, rank_zero_only: bool = True) -> dict[str, Any]:
        """The module state with the LightningModule's names, as Lightning's FSDPStrategy gives
        it for its `state_dict_type`. With "full": the whole state (fp32 master weights,
        buffers), detached, on CPU (or the compute device with `state_dict_to_cpu=False`), on
        rank 0: the other ranks send it their shards and get an empty dict (see [Note: full
        checkpoints] in full_checkpoint.py); with `rank_zero_only=False` every rank gets it;
        a collective: call it on every rank. With "sharded": this rank's shards, without a
        copy or a collective (`shardwise.checkpoint.sharded_state_dict`), so that no rank
        gathers the whole model when Lightning builds a checkpoint the engine writes sharded;
        `strategy.zero_model.state_dict()` gives the whole state there."""
        if self._zero_model is None:
            assert self.lightning_module is not None
            return self.lightning_module.state_dict()
        return self._checkpoints.module_state_dict(
            self._zero_model, rank_zero_only=rank_zero_only, device=self.state_dict_device()
        )

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state for Lightning's checkpoint (see `Checkpoints.optimizer_state`):
        with "full" a collective."""
        return self._checkpoints.optimizer_state(optimizer)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write the checkpoint at `filepath` in the form `state_dict_type` names, with the
        engine's model and optimizer (see `Checkpoints.save`); a collective."""
        self._checkpoints.check_storage_options(storage_options)
        if self._zero_model is None:
            raise ValueError("nothing to save: the model is not set up by the strategy yet")
        self._check_all_managed("when saving a checkpoint")
        self._checkpoints.save(
            checkpoint,
            Path(self.broadcast(str(filepath))),
            self._zero_model,
            self.zero_optimizer(),
            storage_options=storage_options,
            checkpoint_io=self.checkpoint_io,
            is_rank_0=self.is_global_zero,
            broadcast=self.broadcast,
        )

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a sharded checkpoint into the engine and return the rest of Lightning's
        checkpoint, or read a single file whole through the CheckpointIO, for
        `load_model_state_dict` to load (see `Checkpoints.load`)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.lightning_module is not None and self._zero_model is not None
        extra = self._checkpoints.load(path, self._zero_model, self._optimizer_to_restore())
        if extra is not None:
            return extra
        return super().load_checkpoint(path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the checkpoint's weights (and, when fitting, optimizer state) into the engine,
        after the LightningModule's on_load_checkpoint, which may have rebuilt layers (see
        [Note: layers rebuilt in on_load_checkpoint] in checkpoints.py)."""
        assert self._zero_model is not None
        rebuilt = bool(self._unmanaged_parameters())
        if rebuilt:
            self._shard_rebuilt_module()
        self._checkpoints.load_model_state(
            checkpoint,
            self._zero_model,
            self._optimizer_to_restore(),
            strict=strict,
            rewrapped=rebuilt,
        )

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # the engine restored it in load_checkpoint or load_model_state_dict

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a shardwise checkpoint (the link and the directory it names)."""
        if not self.is_global_zero:
            return
        path = Path(filepath)
        if path.is_symlink():
            remove_sharded_checkpoint(path)
        else:
            super().remove_checkpoint(filepath)

    def _fitting(self) -> bool:
        assert self.lightning_module is not None
        return bool(self.lightning_module.trainer.state.fn == TrainerFn.FITTING)

    def _optimizer_to_restore(self) -> ZeroOptimizer | None:
        """The engine's optimizer when fitting, which a checkpoint restores; else None."""
        if not self._fitting():
            return None
        optimizer = self.zero_optimizer()
        assert optimizer is not None  # setup_optimizers wrapped one for the fit
        return optimizer

    def _shard_rebuilt_module(self) -> None:
        # See [Note: layers rebuilt in on_load_checkpoint] in checkpoints.py.
        old = self._zero_model
        assert old is not None and self.lightning_module is not None
        previous = optimizer_of(old)
        if previous is not None:
            previous.close()
        module = old.release_module()
        self._zero_model = wrap_model(module, self.engine_config(self.root_device))
        self._engines[id(module)] = self._zero_model
        self.model = self._zero_model
        if self._fitting():
            self.setup_optimizers(self.lightning_module.trainer)

    # ---- every entry: the module is still the one the engine sharded ----------------------------

    def _unmanaged_parameters(self) -> list[str]:
        return [] if self._zero_model is None else unmanaged_parameters(self._zero_model)

    def _check_all_managed(self, when: str) -> None:
        if self._zero_model is not None:
            check_all_managed(self._zero_model, when)

    def on_train_start(self) -> None:
        self._check_all_managed("at the start of fit")

    def on_validation_start(self) -> None:
        self._check_all_managed("at the start of validation")

    def on_test_start(self) -> None:
        self._check_all_managed("at the start of test")

    def on_predict_start(self) -> None:
        self._check_all_managed("at the start of predict")

    # ---- end -----------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Release the plugins and, after a run that finished, give the LightningModule its
        whole parameters (`hand_back_whole_module`). The engine keeps the module's chunks, so a
        later fit/validate/test/predict of the same Trainer reuses it."""
        assert self.cluster_environment is not None and self.accelerator is not None
        finished = run_finished(self.lightning_module)
        if self._recorder is not None:  # the fit ends here: so does its run on the dashboard
            self._recorder.finish(error=None if finished else "the fit did not finish")
            self._recorder = None
        whole_state_call = self._checkpoints.whole_state_call()  # named if it stays sharded
        hand_back_whole_module(
            self._zero_model, finished=finished, whole_state_call=whole_state_call
        )
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
