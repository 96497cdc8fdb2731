"""The transformers versions this adapter is built against, and finding the callback's Trainer.

The callback relies on these facts of transformers 5.x (see [Note: how the Trainer's loop
reaches the engine]): `Trainer.__init__` calls `on_init_end` after building its accelerator;
`train()` builds the optimizer only when `trainer.optimizer` is None, prepares the model with
accelerate only when `_wrap_model` returns `trainer.model` itself, and scales the loss with
`accelerator.scaler` when one is set; `evaluation_loop` calls `trainer.model` under
`torch.no_grad()` and leaves a model flagged `_is_accelerate_prepared` as it is. A transformers
outside the tested range is refused at start-up rather than trained on silently.
"""

from __future__ import annotations

import sys
from typing import Any

import transformers
from transformers import Trainer

SUPPORTED_MAJOR = 5
TESTED = "5.23.0"


def check_transformers_version(version: str | None = None) -> None:
    """Raise a RuntimeError naming the installed transformers when it is not a 5.x release."""
    found = version or transformers.__version__
    major = found.split(".", 1)[0]
    if not major.isdigit() or int(major) != SUPPORTED_MAJOR:
        raise RuntimeError(
            f"shardwise-hf supports transformers 5.x (tested with {TESTED}); found {found}. "
            f"Install a supported version: pip install 'transformers>=5,<6'"
        )


def find_trainer(callback: Any, *, max_depth: int = 8) -> Trainer:
    """The Trainer whose `__init__` is calling `callback.on_init_end`, found among the calling
    frames (the Trainer hands callbacks its model and optimizer, never itself)."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer) and any(
            cb is callback for cb in candidate.callback_handler.callbacks
        ):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    raise RuntimeError(
        "ShardwiseCallback could not find the Trainer it was given to: pass it in "
        "Trainer(callbacks=[ShardwiseCallback(...)]), or call callback.attach(trainer) "
        "before trainer.train()"
    )
