"""What the strategies refuse before a run: Trainer settings the engine cannot honour, and
parameters of the LightningModule that the engine does not manage."""

from __future__ import annotations

from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.utilities.model_helpers import is_overridden

from shardwise import ZeroModel
from shardwise.prepare.ignore import is_ignored


def check_trainer(trainer: Trainer, module: LightningModule) -> None:
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


def unmanaged_parameters(engine: ZeroModel) -> list[str]:
    """Names of the wrapped module's parameters that no chunk of `engine` holds."""
    manages = engine.chunk_manager.manages
    return [
        name
        for name, param in engine.module.named_parameters()
        if not manages(param) and not is_ignored(param)
    ]


def check_all_managed(engine: ZeroModel, when: str) -> None:
    """Raise when the LightningModule holds parameters the engine does not manage: a layer
    built or replaced after the strategy sharded the module (in setup after the first fit,
    between Trainer calls; not in on_load_checkpoint, see [Note: layers rebuilt in
    on_load_checkpoint] in checkpoints.py). Such a layer would run unsharded, be left out of
    checkpoints and loads, and fail at stage 3's next gather."""
    strays = unmanaged_parameters(engine)
    if strays:
        shown = ", ".join(strays[:5]) + (f" and {len(strays) - 5} more" if len(strays) > 5 else "")
        raise ValueError(
            f"{len(strays)} parameter(s) of the LightningModule are not managed by the "
            f"shardwise engine {when}: {shown}. A layer was built or replaced after the "
            f"strategy sharded the module (e.g. in setup or between Trainer calls), so it "
            f"would run unsharded and never be loaded or saved. Build every layer in "
            f"__init__ or configure_model (or, to rebuild layers for a checkpoint, in "
            f"on_load_checkpoint) and let the checkpoint fill its weights (ckpt_path=... "
            f"loads them into the shards); to change the architecture, build a new "
            f"LightningModule and a new Trainer"
        )
