"""The LightningModule after a run: its whole values handed back, or a word on why not.

[Note: the module after a run]
Users treat the LightningModule as theirs again once trainer.fit (or validate, test, predict)
returns: `model.state_dict()`, `torch.save`, reading a weight, often on rank 0 only. Lightning's
own strategies hand it back whole (moved to CPU). Ours keep parameters in chunks, where a
sharded parameter holds no element, so a module left as it is would save empty tensors without
a word. At the end of every run that finished, the strategy's teardown therefore gives the
module its whole fp32 values in host memory, on every rank (`ZeroModel.gather_module`: one
all-gather; see [Note: a module at rest] in shardwise/engine/module_at_rest.py). The engine
keeps its chunks and optimizer state, so `trainer.save_checkpoint` still works after fit, and
the next run of the same module shards the values the module holds then (changed in place or
by load_state_dict). A run that raised skips the gather: another rank may never reach that
collective.
"""

from __future__ import annotations

from pytorch_lightning import LightningModule
from pytorch_lightning.trainer.states import TrainerStatus
from pytorch_lightning.utilities import rank_zero_warn

from shardwise import ZeroModel
from shardwise.engine.module_at_rest import ModuleState, agree_to_gather, whole_copy_bytes


def run_finished(module: LightningModule | None) -> bool:
    """Whether the run tearing down finished (Lightning marks a run that raised INTERRUPTED
    before its teardown, and sets FINISHED only after it)."""
    # `_trainer`, as Lightning's own strategies read it at teardown: the `trainer` property
    # raises when an error came before the module was attached to the Trainer.
    trainer = getattr(module, "_trainer", None)
    return trainer is not None and trainer.state.status == TrainerStatus.RUNNING


def hand_back_whole_module(
    engine: ZeroModel | None, *, finished: bool, whole_state_call: str
) -> None:
    """Give the engine's module its whole parameters after a run that finished on every rank,
    when a whole copy fits in host memory; else warn how to take the weights (see [Note: the
    module after a run]). A collective while the module is sharded: call it on every rank.

    Args:
        engine: the engine whose module the run used (None: nothing was set up).
        finished: whether this rank's run finished (`run_finished`).
        whole_state_call: the call that gives the whole weights under the strategy's
            state_dict_type, named in the warning.
    """
    if engine is None or engine.module_state is not ModuleState.SHARDED:
        return
    # Every rank says whether its run finished, a rank whose run raised included, so no rank
    # waits in a gather another will not join.
    all_finished, room = agree_to_gather(engine.chunk_manager, ready=finished)
    if all_finished and room:
        engine.gather_module()
    elif all_finished:
        gib = whole_copy_bytes(engine.chunk_manager) / 2**30
        rank_zero_warn(
            f"the LightningModule keeps its parameters sharded after this run (empty outside "
            f"the engine): a whole fp32 copy, {gib:.1f} GiB per rank, would not fit in this "
            f"host's memory. Take its weights with {whole_state_call}, called on every rank "
            f"(rank 0 gets them), or trainer.save_checkpoint(path)"
        )
