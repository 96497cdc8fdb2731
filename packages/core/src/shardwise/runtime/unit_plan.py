"""Stage 3: which modules' hooks gather which parameters.

[Note: gather units]
Stage 3 gathers a parameter's chunk before the code that uses it runs and releases it after.
Hooks do that at *gather units*: modules whose forward holds every use of the parameters they
govern, so that the parameters are whole, and registered on their modules as their compute
faces (see [Note: two faces of a stage-3 parameter] in chunk/parameters.py), from the unit's
pre-forward hook to its post-forward hook. Hooks sit at units, not at every module that owns
a parameter: fewer hooks, and none inside a region the user compiled, so `torch.compile` of a
block, or of the whole model with a graph break at each unit, traces plain tensors.

The units, outermost first:
  1. blocks whose children may run on some ranks and not others (experts behind a router),
     and the modules named in `gather_units` (see [Note: conditional units] in
     runtime/gather_units.py);
  2. modules compiled on their own (`torch.compile(block)`, `block.compile()`), other than the
     model itself;
  3. when the model is compiled as a whole (before wrapping, or by `torch.compile` of the
     wrapped model, which its first compiled call reveals), the repeated blocks of the
     model: the children of its outermost `nn.ModuleList`, `nn.ModuleDict` and
     `nn.Sequential` containers (a transformer's layers), so that the compiled graph breaks at
     each block, not at each layer;
  4. every other module that owns parameters, for those parameters (in eager code the finest
     units, whose chunks are gathered for the shortest time).
A parameter registered on modules of different units (a tied embedding and output head), or
used inside a unit other than its own (a weight handed to another module's forward, as
ColossalAI's test model `nested_model` does), is governed instead by the innermost module
holding all of them. Registrations are read from the model; uses elsewhere are learned in its
first forward, in which a sharded parameter used outside its unit is gathered on use (its
chunk then stays gathered until that pass's backward ends) and the use recorded; the units are
then planned again with those parameters moved, once, and any later such use raises, naming
the parameter. A parameter handed to a unit as an argument is seen by the unit's pre-forward
hook in that pass (a unit compiled on its own would otherwise trace it sharded).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from shardwise.chunk import Chunk, ChunkManager

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True, slots=True)
class Registration:
    """One place a parameter of a sharded chunk is registered, with both its faces."""

    module: nn.Module
    name: str
    sharded: nn.Parameter
    compute: nn.Parameter


@dataclass(slots=True)
class GatherUnit:
    """A module whose hooks gather the chunks of the parameters it governs."""

    name: str
    module: nn.Module
    places: list[tuple[Chunk, int]] = field(default_factory=list)
    registrations: list[Registration] = field(default_factory=list)

    def swap_in(self) -> None:
        """Register the compute faces (the unit is about to run)."""
        for r in self.registrations:
            r.module._parameters[r.name] = r.compute

    def swap_out(self) -> None:
        """Register the sharded faces again (the unit has run)."""
        for r in self.registrations:
            r.module._parameters[r.name] = r.sharded


def plan_gather_units(
    root: nn.Module,
    chunk_manager: ChunkManager,
    conditional: Iterable[str] = (),
    used_in: dict[str, set[str]] | None = None,
    *,
    blocks: bool = False,
) -> list[GatherUnit]:
    """The gather units of `root`, in module order (see [Note: gather units]).

    Args:
        root: the user's model.
        chunk_manager: its chunks.
        conditional: qualified names of the conditional units (`find_gather_units`).
        used_in: per parameter name (as packed), the names of the units its first forward
            used it in besides its own.
        blocks: make the repeated blocks units (rule 3: the model is compiled as a whole).
    """
    modules = dict(root.named_modules())
    roots = _unit_roots(root, set(conditional), blocks=blocks or compiled(root))
    registered: dict[int, list[tuple[str, str]]] = {}  # id(param) -> (module name, attribute)
    params: dict[int, nn.Parameter] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for attribute, param in module._parameters.items():
            if param is not None and chunk_manager.manages(param):
                registered.setdefault(id(param), []).append((module_name, attribute))
                params[id(param)] = param
    governed: dict[str, list[int]] = {}
    for key, places in registered.items():
        homes = {_innermost_root(module_name, roots) for module_name, _ in places}
        chunk, index = chunk_manager.locate(params[key])
        homes |= (used_in or {}).get(chunk.tensors[index].name, set())
        governed.setdefault(_common_ancestor(homes), []).append(key)
    units = []
    for name in modules:  # module order: a unit precedes the units inside it
        if name not in governed:
            continue
        unit = GatherUnit(name, modules[name])
        for key in governed[name]:
            chunk, index = chunk_manager.locate(params[key])
            unit.places.append((chunk, index))
            if chunk.keep_gathered:
                continue
            compute = chunk.tensors[index].compute
            for module_name, attribute in registered[key]:
                unit.registrations.append(
                    Registration(modules[module_name], attribute, params[key], compute)
                )
        units.append(unit)
    return units


def _unit_roots(root: nn.Module, conditional: set[str], *, blocks: bool) -> set[str]:
    """Qualified names of the modules that are units by rules 1-3 of [Note: gather units]."""
    roots: set[str] = set()

    def visit(name: str, module: nn.Module, in_container: bool) -> None:
        block = blocks and in_container and _owns_any(module)
        if name in conditional or (module is not root and compiled(module)) or block:
            roots.add(name)
            return
        container = isinstance(module, _CONTAINERS)
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, container)

    visit("", root, False)
    return roots


def compiled(module: nn.Module) -> bool:
    """Whether `module` is compiled on its own (`torch.compile(module)`, `module.compile()`)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule) or module._compiled_call_impl is not None


def _owns_any(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _innermost_root(module_name: str, roots: set[str]) -> str:
    """The unit a parameter registered on `module_name` belongs to by its registration: the
    innermost unit root holding the module, else the module itself (rule 4)."""
    parts = module_name.split(".") if module_name else []
    for end in range(len(parts), -1, -1):
        candidate = ".".join(parts[:end])
        if candidate in roots:
            return candidate
    return module_name


def _common_ancestor(names: set[str]) -> str:
    """The innermost module holding every module in `names` (qualified names; "" the root)."""
    split = [name.split(".") if name else [] for name in names]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
