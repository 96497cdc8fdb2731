"""A strategy's checkpoints, in the form its `state_dict_type` names.

`ShardwiseStrategyBase` keeps Lightning's state-dict and checkpoint hooks (Lightning calls them
on the strategy) and hands each to its `Checkpoints` with the engine it holds at that moment:
the module's and the optimizer's state dicts, a checkpoint saved "full" (one file from rank 0,
see [Note: full checkpoints] in full_checkpoint.py) or "sharded" (a directory, every rank its
shards, written by `shardwise.checkpoint`), and either form loaded into the engine's shards.

[Note: layers rebuilt in on_load_checkpoint]
Lightning restores a checkpoint after the strategy sharded the module, and the idiom of its
fully sharded strategies' tests (and of users porting them) rebuilds layers in
on_load_checkpoint, "to load the full state dict into a new unwrapped model". The new layers'
parameters are no chunk's, so the engine hands the module back whole
(`ZeroModel.release_module`: one gather of the kept layers' values), a new engine wraps it with
the same configuration, rebuilt layers included (`ShardwiseStrategyBase.load_model_state_dict`),
and the checkpoint loads into that one (`Checkpoints.load_model_state`); when fitting,
configure_optimizers runs again, over the new parameters. Costs one whole copy of the module per
rank while it is rewrapped, as the end of a run does (see [Note: the module after a run] in
module_after_run.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, cast

import torch
from lightning_fabric.plugins import CheckpointIO
from torch.nn import Module
from torch.optim import Optimizer

from shardwise import ZeroModel, ZeroOptimizer
from shardwise import checkpoint as sharded_checkpoint
from shardwise.checkpoint import CheckpointError
from shardwise.checkpoint.consolidate import PARAM_GROUP_NAMES, SHARDWISE_KEY
from shardwise.engine.module_at_rest import ModuleState, write_whole_values
from shardwise_lightning.checkpoint_paths import is_sharded_checkpoint
from shardwise_lightning.full_checkpoint import save_on_rank_0, write_full_checkpoint

StateDictType = Literal["sharded", "full"]
STATE_DICT_TYPES: tuple[str, ...] = ("sharded", "full")


class Checkpoints:
    """Saves and loads one strategy's checkpoints and state dicts, in the form
    `state_dict_type` names; remembers what a save needs from the optimizer's setup and what
    a load read until the weights go into the engine.

    Args:
        state_dict_type: "full" or "sharded" (see `ShardwiseStrategyBase`).
    """

    def __init__(self, state_dict_type: str) -> None:
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(
                f"state_dict_type must be one of {', '.join(map(repr, STATE_DICT_TYPES))}, got "
                f"{state_dict_type!r}"
            )
        self.state_dict_type = cast(StateDictType, state_dict_type)
        # Per optimizer parameter group, its parameters' names in group order: how torch
        # numbers them in an optimizer state dict (see [Note: consolidated checkpoints] in
        # shardwise/checkpoint/consolidate.py).
        self._param_group_names: list[list[str]] = []
        self._loaded_sharded = False
        self._loaded_path = Path()

    def record_param_groups(self, module: Module, optimizer: Optimizer) -> None:
        """Remember the names in `module` of the parameters of each of `optimizer`'s groups
        (as configure_optimizers gave them), which a sharded checkpoint saves beside the
        optimizer's state."""
        names = {id(p): name for name, p in module.named_parameters()}
        self._param_group_names = [
            [names[id(p)] for p in group["params"] if id(p) in names]
            for group in optimizer.param_groups
        ]

    def whole_state_call(self) -> str:
        """How a user takes the whole weights from the engine under this state_dict_type."""
        if self.state_dict_type == "sharded":
            return "trainer.strategy.zero_model.state_dict()"
        return "trainer.strategy.lightning_module_state_dict()"

    # ---- state dicts -------------------------------------------------------------------------

    def module_state_dict(
        self, engine: ZeroModel, *, rank_zero_only: bool, device: torch.device
    ) -> dict[str, Any]:
        """The module state of `engine` for `lightning_module_state_dict`: with "full" the
        whole state, on `device`, on rank 0 (with `rank_zero_only=False` on every rank; a
        collective); with "sharded" this rank's shards, without a copy or a collective."""
        if self.state_dict_type == "sharded":
            if engine.module_state is ModuleState.WHOLE:
                # See [Note: the module after a run] in module_after_run.py: the values the
                # module holds now.
                write_whole_values(engine.chunk_manager)
            return sharded_checkpoint.sharded_state_dict(engine)
        state = engine.state_dict(only_rank_0=rank_zero_only)
        if device.type != "cpu":
            state = {
                k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()
            }
        return state

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The state of `optimizer` (the engine's, or Lightning's wrapper of it) for Lightning's
        checkpoint. With "full" the whole optimizer state in torch's format, on rank 0 (other
        ranks get an empty dict; a collective), which `save` writes as it is (see [Note: full
        checkpoints] in full_checkpoint.py); with "sharded" this rank's shards, which `save`
        does not read (the engine writes its own)."""
        engine = getattr(optimizer, "_optimizer", optimizer)
        if self.state_dict_type == "full" and isinstance(engine, ZeroOptimizer):
            return sharded_checkpoint.gather_optimizer_state(engine, only_rank_0=True)
        return cast(dict[str, Any], engine.state_dict())

    # ---- saving ------------------------------------------------------------------------------

    def check_storage_options(self, storage_options: Any | None) -> None:
        """Refuse `storage_options` where no CheckpointIO writes the checkpoint."""
        if storage_options is not None and self.state_dict_type == "sharded":
            raise TypeError(
                "save_checkpoint(storage_options=...) cannot be honoured: sharded checkpoints "
                "are written by the engine, not through a CheckpointIO (state_dict_type='full' "
                "writes through it)"
            )

    def save(
        self,
        checkpoint: dict[str, Any],
        path: Path,
        engine: ZeroModel,
        optimizer: ZeroOptimizer | None,
        *,
        storage_options: Any | None,
        checkpoint_io: CheckpointIO,
        is_rank_0: bool,
        broadcast: Callable[[Any], Any],
    ) -> None:
        """Write Lightning's `checkpoint` dict at `path` (the same on every rank): the model
        and, unless weights only, optimizer and loss scaler from `engine` and `optimizer`, with
        the rest of Lightning's checkpoint (loops, schedulers, callbacks). With "full" one
        ordinary file from rank 0 through `checkpoint_io` (see [Note: full checkpoints] in
        full_checkpoint.py), `broadcast` (the strategy's) telling every rank how the write
        went; with "sharded" a directory, every rank its shards, world-size independent.
        Either form replaces a checkpoint of the other under the same name (see [Note: saving
        over an earlier checkpoint] in checkpoint_paths.py); an ordinary directory is refused.
        A collective."""
        if self.state_dict_type == "full":
            # One file from rank 0 (see [Note: full checkpoints] in full_checkpoint.py).
            save_on_rank_0(
                path,
                lambda: write_full_checkpoint(checkpoint_io, checkpoint, path, storage_options),
                is_rank_0=is_rank_0,
                broadcast=broadcast,
            )
            return
        if engine.module_state is ModuleState.WHOLE:
            # Saved after a run (see [Note: the module after a run] in module_after_run.py): the
            # checkpoint reads the shards, so they take the values the module holds first; it
            # keeps them (a local copy, where sharding the module and gathering it again would
            # free and rebuild a whole copy of it, with a collective).
            write_whole_values(engine.chunk_manager)
        saved_optimizer = optimizer if "optimizer_states" in checkpoint else None
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if saved_optimizer is not None:
            rest[PARAM_GROUP_NAMES] = self._param_group_names
        # A full checkpoint file of the same name is replaced (see [Note: saving over an
        # earlier checkpoint] in checkpoint_paths.py).
        sharded_checkpoint.save(path, engine, saved_optimizer, extra=rest, replace_file=True)

    # ---- loading -----------------------------------------------------------------------------

    def load(
        self, path: Path, engine: ZeroModel, optimizer: ZeroOptimizer | None
    ) -> dict[str, Any] | None:
        """Load the sharded checkpoint at `path` (from any world size) into `engine` and, unless
        None, `optimizer`, and return the rest of Lightning's checkpoint. None when `path` is a
        single file (a full checkpoint of these strategies, `shardwise consolidate`'s output, or
        one of any Lightning strategy), which the strategy's CheckpointIO reads whole and
        `load_model_state` loads, after the LightningModule's on_load_checkpoint. Remembers
        which it was for `load_model_state`."""
        self._loaded_path = path
        if not is_sharded_checkpoint(path):
            self._loaded_sharded = False
            return None
        extra = dict(sharded_checkpoint.load(path, engine, optimizer))
        self._loaded_sharded = True
        extra.pop(PARAM_GROUP_NAMES, None)
        return extra

    def load_model_state(
        self,
        checkpoint: Mapping[str, Any],
        engine: ZeroModel,
        optimizer: ZeroOptimizer | None,
        *,
        strict: bool,
        rewrapped: bool,
    ) -> None:
        """Load the weights of the checkpoint `load` read last into `engine` and, unless None,
        the optimizer state into `optimizer`: from a single file, its whole state sliced into
        this rank's shards; from a sharded checkpoint nothing more, `load` wrote the shards,
        unless the module was `rewrapped` since into a new `engine` (see [Note: layers rebuilt
        in on_load_checkpoint]), which the shards are read into again."""
        if self._loaded_sharded:
            if rewrapped:
                # The shards were read into the engine the rebuilt layers left behind.
                sharded_checkpoint.load(self._loaded_path, engine, optimizer)
            return
        engine.load_state_dict(checkpoint["state_dict"], strict=strict)
        if optimizer is not None and checkpoint.get("optimizer_states"):
            self._load_whole_optimizer_state(checkpoint, optimizer)

    def _load_whole_optimizer_state(
        self, checkpoint: Mapping[str, Any], optimizer: ZeroOptimizer
    ) -> None:
        """Slice a torch-format optimizer state (numbered by the parameter groups of
        configure_optimizers, as every Lightning strategy saves it) into this rank's shards;
        the loss scaler's state rides under "shardwise"."""
        states = checkpoint["optimizer_states"]
        scaler = checkpoint.get(SHARDWISE_KEY, {}).get("grad_scaler")
        fix = (
            "resume with the same configure_optimizers, or load the weights alone "
            "(trainer.validate(ckpt_path=...), or a checkpoint saved with "
            "save_weights_only=True)"
        )
        if len(states) != 1:
            raise ValueError(
                f"{self._loaded_path} holds optimizer state for {len(states)} optimizers, but "
                f"configure_optimizers gives one: {fix}"
            )
        whole = dict(states[0])
        if scaler is not None:
            whole["loss_scaler"] = scaler
        try:
            sharded_checkpoint.load_optimizer_state(optimizer, whole)
        except CheckpointError as error:
            raise ValueError(f"{self._loaded_path}: {error}; {fix}") from error
