"""The file names of Hugging Face and ColossalAI checkpoints.

A sharded model directory holds `pytorch_model-00001.bin`, ... (or `model-00001.safetensors`,
...) and an index, `pytorch_model.bin.index.json` (`model.safetensors.index.json`), whose
`weight_map` names the file of every key: `from_pretrained` reads it, and so do ColossalAI and
shardwise. An optimizer directory holds `pytorch_optim-00001.bin`, ..., the parameter groups
in `pytorch_optim_group.bin` and `pytorch_optim.bin.index.json`. A `prefix` goes before the
suffix of every name: `pytorch_model.<prefix>.bin`, as ColossalAI writes it.
"""

from __future__ import annotations

WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
STATES_NAME = "pytorch_optim.bin"
STATES_INDEX_NAME = "pytorch_optim.bin.index.json"
GROUP_FILE_NAME = "pytorch_optim_group.bin"
INDEX_SUFFIX = ".index.json"


def with_prefix(name: str, prefix: str | None) -> str:
    """`name` with `prefix` before its suffix: `pytorch_model.bin` -> `pytorch_model.p.bin`."""
    if not prefix:
        return name
    stem, _, suffix = name.rpartition(".")
    return f"{stem}.{prefix}.{suffix}"


def model_file_names(prefix: str | None, use_safetensors: bool) -> tuple[str, str]:
    """The base weights name and the index name of a sharded model directory."""
    if use_safetensors:
        return with_prefix(SAFE_WEIGHTS_NAME, prefix), with_prefix(SAFE_WEIGHTS_INDEX_NAME, prefix)
    return with_prefix(WEIGHTS_NAME, prefix), with_prefix(WEIGHTS_INDEX_NAME, prefix)


def optimizer_file_names(prefix: str | None) -> tuple[str, str, str]:
    """The base states name, the index name and the parameter-group file of an optimizer
    directory."""
    return (
        with_prefix(STATES_NAME, prefix),
        with_prefix(STATES_INDEX_NAME, prefix),
        with_prefix(GROUP_FILE_NAME, prefix),
    )


def shard_file_name(base: str, number: int) -> str:
    """The `number`-th (from 1) file of a sharded checkpoint whose single file would be
    `base`: `pytorch_model.bin` -> `pytorch_model-00001.bin`."""
    stem, _, suffix = base.rpartition(".")
    return f"{stem}-{number:05d}.{suffix}"
