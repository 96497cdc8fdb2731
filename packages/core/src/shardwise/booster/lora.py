"""LoRA through the Booster (ColossalAI's `enable_lora` / `save_lora_as_pretrained`), for every
plugin: peft adds the adapters before `boost`, and the adapters are written back as peft's
`save_pretrained` writes them.

[Note: LoRA on the engine]
peft's `get_peft_model` freezes the base weights (`requires_grad=False`) and adds small trainable
`lora_A` / `lora_B` layers; the parameter objects of the base model stay the same. The engine
packs frozen and trainable parameters into separate chunks and steps only trainable ones, so
the ZeRO plugins, Gemini included (which ColossalAI refuses), train a peft model as they train
any model with frozen parts, with the optimizer built over `model.parameters()` (frozen ones are
left out of the step) or over the trainable ones only. An optimizer built over the base model
before `enable_lora` holds no adapter: each adapter then joins the parameter group of the base
weight it adapts, as ColossalAI's LowLevelZeroPlugin does, so it trains instead of silently not;
so does the trainable copy peft makes of a `modules_to_save` module (a classifier head), which
ColossalAI leaves out (its head then never trains).

Saving gathers only the chunks that hold what peft saves (the adapters; `modules_to_save`),
one chunk at a time, in fp32 master precision; rank 0 writes, and its outcome reaches every
rank, so no rank waits for a file that never comes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from shardwise import comm
from shardwise.comm import CommStats
from shardwise.engine.model import _WRAPPED_MARK, ZeroModel
from shardwise.engine.state_dict import gathered_chunks
from shardwise.interface import ModelWrapper

if TYPE_CHECKING:
    from peft import PeftModel


def enable_lora(
    plugin_name: str,
    model: nn.Module,
    pretrained_dir: str | None,
    lora_config: Any,
    bnb_quantization_config: Any,
    quantize: bool,
) -> nn.Module:
    """`model` with peft's LoRA adapters: new ones from `lora_config` (`get_peft_model`), or
    the ones saved in `pretrained_dir`, trainable (`PeftModel.from_pretrained(...,
    is_trainable=True)`, with `lora_config` in place of the saved configuration when given).

    Args:
        plugin_name: for messages.
        model: the user's module, not yet boosted.
        pretrained_dir: a directory `save_lora_as_pretrained` (or peft) wrote, or None.
        lora_config: a `peft.LoraConfig`; required without `pretrained_dir`.
        bnb_quantization_config, quantize: refused unless None / False.
    """
    peft = _import_peft()
    if quantize or bnb_quantization_config is not None:
        raise ValueError(
            f"{plugin_name}: quantize=True / bnb_quantization_config cannot be honoured: "
            f"shardwise does not quantise base weights (QLoRA); leave them at their defaults "
            f"(quantize=False, bnb_quantization_config=None)"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    boosted = isinstance(model, (ZeroModel, ModelWrapper))
    # The module inside a boosted model: its parameters are views of the engine's chunks.
    if boosted or any(getattr(m, _WRAPPED_MARK, False) for m in model.modules()):
        raise ValueError(
            f"{plugin_name}: enable_lora needs the model before boost, got a boosted "
            f"{type(model).__name__}: call booster.enable_lora(model, ...) first, then "
            f"booster.boost(model, optimizer)"
        )
    if lora_config is not None and not isinstance(lora_config, peft.LoraConfig):
        raise TypeError(
            f"lora_config must be a peft.LoraConfig, got {type(lora_config).__name__}: build "
            f"one with peft.LoraConfig(r=..., target_modules=[...])"
        )
    if pretrained_dir is None:
        if lora_config is None:
            raise ValueError(
                "enable_lora needs lora_config=peft.LoraConfig(...) for new adapters, or "
                "pretrained_dir= (a directory save_lora_as_pretrained wrote) to load them"
            )
        peft_model: nn.Module = peft.get_peft_model(model, lora_config)
        return peft_model
    # A directory without adapters (a Hub model id is peft's to resolve).
    config_file = Path(pretrained_dir, "adapter_config.json")
    if Path(pretrained_dir).is_dir() and not config_file.is_file() and lora_config is None:
        raise ValueError(
            f"pretrained_dir={pretrained_dir!r} has no adapter_config.json: give the directory "
            f"save_lora_as_pretrained wrote, or pass lora_config="
        )
    loaded: nn.Module = peft.PeftModel.from_pretrained(
        model, pretrained_dir, is_trainable=True, config=lora_config
    )
    return loaded


def add_adapters_to_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Put each trainable parameter peft added that `optimizer` lacks into the group of the
    base weight it stands beside (see [Note: LoRA on the engine]): a LoRA layer's adapters
    join its base layer's group, a `modules_to_save` copy (a classifier head, say) the group
    of the original it copies. Nothing for a model without peft's layers."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    for added, bases in _added_parameters(model):
        group = next((group_of[id(b)] for b in bases if id(b) in group_of), None)
        if group is None or id(added) in group_of or not added.requires_grad:
            continue  # its base is not in this optimizer (neither is it), or it is already
        group["params"].append(added)
        group_of[id(added)] = group


def _added_parameters(model: nn.Module) -> list[tuple[nn.Parameter, list[nn.Parameter]]]:
    """(a parameter peft added, the base parameters it belongs with), for peft's layers."""
    pairs = []
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        original = getattr(module, "original_module", None)
        copies = getattr(module, "modules_to_save", None)
        if isinstance(base, nn.Module) and hasattr(module, "lora_A"):  # a LoRA layer
            base_params = list(base.parameters())
            pairs += [
                (p, base_params)
                for name, p in module.named_parameters()
                if not name.startswith("base_layer.")
            ]
        elif isinstance(original, nn.Module) and isinstance(copies, nn.ModuleDict):
            originals = dict(original.named_parameters())
            for copy in copies.values():
                pairs += [
                    (p, [originals[name]])
                    for name, p in copy.named_parameters()
                    if name in originals
                ]
    return pairs


def saved_tensors(peft_model: PeftModel) -> dict[str, torch.Tensor]:
    """The model's tensors that peft's `save_pretrained` writes (adapters, `modules_to_save`),
    by the model's state-dict names, as the model holds them (parameter objects)."""
    peft = _import_peft()
    tensors = peft_model.state_dict(keep_vars=True)
    # peft chooses by name and configuration; tell its choice by the probes' identity.
    probes = {key: torch.empty(0) for key in tensors}
    chosen = peft.get_peft_model_state_dict(peft_model, state_dict=probes)
    key_of = {id(probe): key for key, probe in probes.items()}
    return {key_of[id(v)]: tensors[key_of[id(v)]] for v in chosen.values() if id(v) in key_of}


def gather_adapters(model: ZeroModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors`' whole values on CPU, on rank 0 of the model's group (others get {}). Only the
    chunks holding them are gathered, one at a time (a collective: every rank calls it)."""
    manager = model.chunk_manager
    keep = comm.rank(model.config.topology.process_group) == 0
    wanted = {id(t) for t in tensors.values() if manager.manages(t)}
    holding = [c for c in manager.chunks if any(id(i.param) in wanted for i in c.tensors)]
    values: dict[int, torch.Tensor] = {}
    for chunk, full in gathered_chunks(manager, holding):
        for info in chunk.tensors:
            if keep and id(info.param) in wanted:
                piece = full[info.offset : info.offset + info.numel].view(info.shape)
                values[id(info.param)] = piece.to("cpu", copy=True)
    if not keep:
        return {}
    return {
        key: values[id(t)] if id(t) in values else t.detach().to("cpu", copy=True)
        for key, t in tensors.items()
    }


def save_adapters(
    peft_model: PeftModel,
    checkpoint: str,
    values: dict[str, torch.Tensor],
    use_safetensors: bool,
    stats: CommStats,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Rank 0 of `group` writes `values` (its `saved_tensors`, gathered) with peft's
    `save_pretrained` into the directory `checkpoint`; every rank returns once the files are
    there, or raises what rank 0 met. Each file is written beside the directory first and
    moved in whole, so a failed save leaves no half-written file behind."""
    problem: str | None = None
    failure: Exception | None = None
    if comm.rank(group) == 0:
        try:
            _write(peft_model, Path(checkpoint), values, use_safetensors)
        except Exception as error:  # whatever it is, the other ranks must hear of it
            problem, failure = f"{type(error).__name__}: {error}", error
    problem = comm.broadcast_object(problem, stats, group)
    if problem is not None:
        raise RuntimeError(f"save_lora_as_pretrained failed on rank 0: {problem}") from failure


def _write(
    peft_model: PeftModel, target: Path, values: dict[str, torch.Tensor], use_safetensors: bool
) -> None:
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} is a file: give the directory to write the adapters into")
    staging = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        peft_model.save_pretrained(
            str(staging), safe_serialization=use_safetensors, state_dict=values
        )
        target.mkdir(parents=True, exist_ok=True)
        for path in staging.rglob("*"):
            if path.is_file():
                destination = target / path.relative_to(staging)
                destination.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def peft_model_of(model: nn.Module, plugin_name: str) -> PeftModel:
    """The PeftModel inside a boosted model, or a clear error."""
    peft = _import_peft()
    inner = model.unwrap() if isinstance(model, (ZeroModel, ModelWrapper)) else model
    if not isinstance(inner, peft.PeftModel):
        raise ValueError(
            f"{plugin_name}: save_lora_as_pretrained needs a model with LoRA adapters, got "
            f"{type(inner).__name__}: call booster.enable_lora(model, lora_config=...) before "
            f"booster.boost"
        )
    return cast("PeftModel", inner)


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as error:
        raise ImportError(
            "LoRA needs Hugging Face peft: pip install 'shardwise[lora]' (or pip install peft)"
        ) from error
    return peft
