"""Stage 3: blocks whose children may run on some ranks and not others, gathered as one unit.

[Note: conditional units]
Stage 3 gathers a module's chunks just before it runs. Gathers are collectives, so every rank
must call the same modules in the same order. A mixture-of-experts layer breaks that: the router
sends this rank's tokens to some experts and another rank's to others, and an expert with no
token is not called. If each expert gathered its own chunks, one rank would wait in an expert's
all-gather while another had gone on to the next layer's, and both would hang (or, where the
sizes happen to agree, each would read the other's parameters).

So a block that holds experts is one gather unit: its pre-forward hook (which every rank runs,
since every rank calls the block) gathers the chunks of every parameter under it, the experts'
own calls issue no collective, and the block's chunks are released after it as one. In backward
the same holds: the block's output gradient gathers them again, and their gradients are reduced
once the block's backward is done on this rank (when the gradients of its inputs are computed:
autograd runs a parameter's gradient accumulation as soon as it is ready, before anything
upstream, so by then every gradient the block gives its own parameters has arrived), with zeros
for the experts that got no token here. Every rank reaches that point at the same place in its
sequence of collectives, whatever the experts did.

A unit is a module with a child container (`nn.ModuleList` or `nn.ModuleDict`) of two or more
modules whose attribute name contains "expert": the layout of the mixture-of-experts layers of
Hugging Face transformers (Switch, Mixtral, Qwen-MoE, ...), DeepSpeed-MoE and hand-written ones.
The cost is memory: all experts of one layer are gathered at once, as FSDP holds one wrapped
block. `find_gather_units` also takes modules to treat so by class or by qualified name, for
conditional blocks laid out otherwise.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from shardwise.chunk import ChunkManager


def find_gather_units(
    module: nn.Module, extra: Iterable[type[nn.Module] | str] = ()
) -> dict[str, nn.Module]:
    """The outermost gather units under `module`, by qualified name, in module order.

    Args:
        module: the user's model.
        extra: module classes, or qualified names, to treat as units besides the blocks that
            hold experts.
    """
    classes: list[type[nn.Module]] = []
    names: set[str] = set()
    for item in extra:
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            classes.append(item)
        else:
            raise TypeError(
                f"a gather unit is an nn.Module class or a module's qualified name, got {item!r}"
            )
    found = dict(module.named_modules())
    unknown = sorted(names - found.keys())
    if unknown:
        raise ValueError(
            f"gather units {unknown} name no module of {type(module).__name__}; "
            f"use names from model.named_modules()"
        )
    units: dict[str, nn.Module] = {}
    for name, submodule in found.items():
        if any(name.startswith(f"{outer}.") or outer == "" for outer in units):
            continue  # inside a unit already: the outer one gathers it
        if name in names or isinstance(submodule, tuple(classes)) or _holds_experts(submodule):
            units[name] = submodule
    return units


def _holds_experts(module: nn.Module) -> bool:
    return any(
        "expert" in child_name.lower()
        and isinstance(child, (nn.ModuleList, nn.ModuleDict))
        and len(child) >= 2
        for child_name, child in module.named_children()
    )


class UnitMap:
    """The gather units of one wrapped model: which modules they cover, which chunk tensors
    their backward governs, and the signal that a unit's backward is done on this rank.

    Args:
        module: the user's model.
        chunk_manager: its chunks.
        units: the units, as `find_gather_units` returns them.
        on_done: called with a unit's index once its backward is done on this rank.
    """

    def __init__(
        self,
        module: nn.Module,
        chunk_manager: ChunkManager,
        units: dict[str, nn.Module],
        on_done: Callable[[int], None] | None = None,
    ) -> None:
        self.names = list(units)
        self._index = {id(unit): i for i, unit in enumerate(units.values())}
        self._inside: set[int] = set()
        unit_of_module: dict[int, int] = {}
        for i, unit in enumerate(units.values()):
            for submodule in unit.modules():
                unit_of_module[id(submodule)] = i
                if submodule is not unit:
                    self._inside.add(id(submodule))
        # A tensor is governed by a unit when only modules inside it own it; one tied to a
        # module outside (or to another unit) gets its gradient from there too, possibly after
        # the unit's backward, so it completes by the arrival of its gradient as usual.
        owners: dict[int, set[int]] = {}
        params: dict[int, nn.Parameter] = {}
        for submodule in module.modules():
            for param in submodule.parameters(recurse=False):
                params[id(param)] = param
                owners.setdefault(id(param), set()).add(unit_of_module.get(id(submodule), -1))
        self.governed: dict[tuple[int, int], int] = {}
        for key, unit_ids in owners.items():
            param = params[key]
            if len(unit_ids) == 1 and -1 not in unit_ids and chunk_manager.manages(param):
                chunk, index = chunk_manager.locate(param)
                self.governed[(chunk.chunk_id, index)] = next(iter(unit_ids))
        self._on_done = on_done
        self._pending = [0] * len(self.names)
        self._unsignalled = [False] * len(self.names)

    def inside_unit(self, module: nn.Module) -> bool:
        """Whether `module` is strictly inside a unit (the unit's hooks cover it)."""
        return id(module) in self._inside

    def index_of(self, module: nn.Module) -> int | None:
        """The unit `module` is the root of, if any."""
        return self._index.get(id(module))

    def watch_backward(self, unit: int) -> Callable[..., Any]:
        """A forward pre-hook for unit `unit`: signal when the gradients of this call's inputs
        are computed (the call's backward is done), once every call of the pass has.

        A leaf input is handed to the unit as a view of itself: a leaf's gradient hook runs
        when its accumulation does, which autograd runs as soon as the first consumer's
        gradient is ready, before the rest of the unit's backward; the view's runs only once
        every consumer inside the unit is done (a re-run forward of reentrant checkpointing
        gets leaf inputs, for instance)."""

        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return None
            args, kwargs = tree_map(_view_of_leaf, (args, kwargs))
            leaves, _ = tree_flatten((args, kwargs))
            inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if not inputs:
                # No input gradient will ever signal this call: the unit's chunks wait for
                # the end of backward, as unused parameters' do.
                self._unsignalled[unit] = True
                return None
            self._pending[unit] += 1
            remaining = [len(inputs)]
            # A graph hook holds the map weakly (see [Note: hooks hold the engine weakly] in
            # runtime/grad_reducer.py): the user may keep the graph (the last loss).
            units = weakref.ref(self)

            def on_input_grad(grad: torch.Tensor) -> None:
                remaining[0] -= 1
                owner = units()
                if remaining[0] == 0 and owner is not None:
                    owner._call_done(unit)

            for tensor in inputs:
                tensor.register_hook(on_input_grad)
            return args, kwargs

        return hook

    def _call_done(self, unit: int) -> None:
        self._pending[unit] -= 1
        if self._pending[unit] == 0 and not self._unsignalled[unit] and self._on_done is not None:
            self._on_done(unit)

    def end_backward(self) -> None:
        """Backward ended: the next forward's calls start counting afresh."""
        self._pending = [0] * len(self.names)
        self._unsignalled = [False] * len(self.names)


def _view_of_leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is None:
        return value.view_as(value)
    return value
