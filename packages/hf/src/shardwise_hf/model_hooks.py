"""Make the user's model object save and load whole while its parameters are sharded.

[Note: whole weights for save_pretrained]
`trainer.save_model()` (and the model files of every Trainer checkpoint) runs
`model.save_pretrained()` on rank 0 only, so the other ranks cannot join a gather there.
The callback therefore gathers the whole model into rank 0's memory at the moments a save is
known to follow, on every rank (a step or epoch end that set `control.should_save`, and the end
of training), and a state-dict hook on the model hands those values to `save_pretrained`.
The result is an ordinary Hugging Face checkpoint: safetensors, split with an index above
`max_shard_size`, with config.json. The cost is the whole model in rank 0's memory, since
`save_pretrained` writes from rank 0 alone (`shardwise.checkpoint.export_hf` and the Booster's
`save_model` have every rank write part of the files instead).

Loading the model files of a Trainer checkpoint on resume goes the other way: a load hook takes
the whole tensors out of the state dict and writes each rank's slice into the chunks, and tells
`load_state_dict` they were loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise import ZeroModel


class ModelHooks:
    """State-dict hooks on the user's model (`engine.module`).

    Args:
        engine: the wrapped model.
    """

    def __init__(self, engine: ZeroModel) -> None:
        self.engine = engine
        self.whole: dict[str, torch.Tensor] | None = None
        self._loaded: set[str] = set()
        module = engine.module
        managed = engine.chunk_manager.manages
        self._managed_names = {
            name
            for name, param in module.named_parameters(remove_duplicate=False)
            if managed(param)
        }
        # torch marks the hooks it is given, which a bound method does not allow: wrap them.
        self._handles: list[RemovableHandle] = [
            module.register_state_dict_post_hook(partial(ModelHooks._fill_whole, self)),
            module.register_load_state_dict_pre_hook(partial(ModelHooks._load_into_chunks, self)),
            module.register_load_state_dict_post_hook(
                partial(ModelHooks._drop_loaded_from_missing, self)
            ),
        ]

    def gather(self) -> None:
        """Gather the whole model (fp32 masters) into rank 0's memory. A collective."""
        self.whole = None  # the engine reads the module's own state dict while gathering
        self.whole = self.engine.state_dict(only_rank_0=True)

    def drop(self) -> None:
        self.whole = None

    def _fill_whole(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        if not self.whole:
            return
        for key in list(state_dict):
            name = key[len(prefix) :]
            if name in self.whole:
                state_dict[key] = self.whole[name]

    def _load_into_chunks(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        whole: OrderedDict[str, Any] = OrderedDict()
        for name in self._managed_names:
            key = prefix + name
            if key in state_dict:
                whole[name] = state_dict.pop(key)
        if whole:
            held, self.whole = self.whole, None  # the engine reads the module's own state dict
            try:
                self.engine.load_state_dict(whole, strict=False)
            finally:
                self.whole = held
        self._loaded = {prefix + name for name in whole}

    def _drop_loaded_from_missing(self, module: nn.Module, incompatible_keys: Any) -> None:
        missing = incompatible_keys.missing_keys
        missing[:] = [key for key in missing if key not in self._loaded]
        self._loaded = set()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
