"""The core package's layers, read from its source: each package imports only those below it,
the engine never imports the ColossalAI-named front doors, and no two modules import each other
(through any chain), type-only imports included."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import shardwise

ROOT = Path(shardwise.__file__).parent
# Lowest first: a package may import those before it, never one after it.
LAYERS = [
    ("comm", "amp", "optim", "testing", "torch_files", "accelerator", "logging", "host_memory"),
    ("memory",),
    ("chunk",),
    ("gemini", "planner", "prepare"),
    ("runtime",),
    ("engine",),
    ("checkpoint", "telemetry", "initialize", "cluster", "nn", "interface", "lazy", "utils"),
    # ColossalAI's zero names return its optimizer interface and state dicts in checkpoint
    # shape, so they sit above both.
    ("zero",),
    ("checkpoint_io",),
    ("booster",),
    ("subcommands",),
    ("cli",),
]
RANK = {package: level for level, packages in enumerate(LAYERS) for package in packages}


def _module_name(path: Path) -> str:
    parts = ("shardwise", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the shardwise modules it imports (a name imported from a package counts as
    its submodule when there is one)."""
    modules = {_module_name(path): path for path in ROOT.rglob("*.py")}
    imports: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardwise"):
                assert node.module is not None
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    imports[name].add(submodule if submodule in modules else node.module)
            elif isinstance(node, ast.Import):
                imports[name].update(a.name for a in node.names if a.name.startswith("shardwise"))
    return imports


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "shardwise"


def test_every_package_is_placed_in_a_layer() -> None:
    packages = {path.relative_to(ROOT).parts[0].removesuffix(".py") for path in ROOT.glob("*")}
    packages -= {"__init__", "__pycache__", "py.typed"}
    assert packages == set(RANK)


def test_packages_import_only_the_layers_below_them() -> None:
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in _imports().items()
        for target in targets
        if _package(module) != "shardwise"  # the top-level names gather every layer
        and _package(target) != _package(module)
        and RANK[_package(target)] >= RANK[_package(module)]
    )
    assert upward == []


def test_no_module_imports_itself_through_a_chain() -> None:
    imports = _imports()
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str], on_path: set[str], done: set[str]) -> None:
        for target in sorted(imports.get(module, ())):
            if target in on_path:
                cycles.append([*path[path.index(target) :], target])
            elif target not in done:
                visit(target, [*path, target], on_path | {target}, done)
        done.add(module)

    done: set[str] = set()
    for module in sorted(imports):
        if module not in done:
            visit(module, [module], {module}, done)
    assert cycles == []
