"""The shardwise strategies for the unified `lightning` package (`import lightning as L`).

`import shardwise_lightning` imports this module where `lightning` is installed, which registers
the strategy names ("shardwise_gemini", ...) with `lightning.pytorch`'s Trainer too. The classes
are imported from here: `from shardwise_lightning.unified import GeminiStrategy`.

[Note: two Lightning namespaces]
Lightning ships its Trainer twice: `pytorch_lightning` (with `lightning_fabric`) and, inside the
unified `lightning` package, `lightning.pytorch` (with `lightning.fabric`). Lightning builds the
second from the first's source by renaming those imports, so the two are disjoint class
hierarchies: `lightning.pytorch.Trainer` refuses a `pytorch_lightning` Strategy, precision
plugin, CheckpointIO or LightningModule (and the other way round), and both may be imported in
one process. Our classes subclass Lightning's, so they must exist once per namespace too.
This package does what Lightning does, at import time: a finder on `sys.meta_path` serves
`shardwise_lightning.unified.X` from the very source file of `shardwise_lightning.X`, with the
module path of each import statement renamed (`pytorch_lightning` -> `lightning.pytorch`,
`lightning_fabric` -> `lightning.fabric`, `shardwise_lightning.` ->
`shardwise_lightning.unified.`) and nothing else changed: one source, two builds, the same
line numbers in tracebacks, no copy to keep in step. Each build has its own classes, registry
entries and module state; `namespace.py` tells a build which one it is.
The top-level names (`shardwise_lightning.GeminiStrategy`, ...) stay the `pytorch_lightning`
build, exactly as before. They cannot pick the namespace of the Trainer they will be given: the
Trainer checks `isinstance(strategy, Strategy)` before it calls any of our code, a class can be
a subclass of only one of the two `Strategy`s (a class of both would run one namespace's code
on the other's objects), and guessing from what the process has imported would depend on
import order once both are (as under pytest, or when a library imports the other one).
Strategy names need no choice: each Trainer looks them up in its own registry. An object of
the wrong namespace is refused by Lightning's Trainer with its own error, which quotes the
object's repr; ours (`namespace.describe`) names both namespaces and the class to import
instead, and our own constructors refuse a plugin of the other namespace with a TypeError
that says the same (`namespace.check_namespace`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

if importlib.util.find_spec("lightning") is None:
    raise ImportError(
        "shardwise_lightning.unified is built on the unified `lightning` package, which is not "
        "installed: pip install 'shardwise-lightning[unified]' (or use pytorch_lightning with "
        "the classes of shardwise_lightning)"
    )

_SOURCE_PACKAGE = "shardwise_lightning"
# The module path at the start of an import statement (at any indentation); a
# `shardwise_lightning` only when a submodule follows.
_IMPORT = re.compile(
    r"^(\s*(?:from|import)\s+)(pytorch_lightning|lightning_fabric|shardwise_lightning(?=\.))\b",
    re.MULTILINE,
)
_RENAMES = {
    "pytorch_lightning": "lightning.pytorch",
    "lightning_fabric": "lightning.fabric",
    _SOURCE_PACKAGE: __name__,
}


def rewrite_imports(source: str) -> str:
    """`source` with the module path of every import of `pytorch_lightning`,
    `lightning_fabric` and a `shardwise_lightning` submodule renamed to its counterpart under
    the `lightning` package (see [Note: two Lightning namespaces]); line numbers are kept.

    Args:
        source: a Python module's source text.
    """
    return _IMPORT.sub(lambda match: match.group(1) + _RENAMES[match.group(2)], source)


# `from shardwise_lightning import X` would bind the other build's X: sources import submodules.
_PACKAGE_IMPORT = re.compile(r"^\s*from\s+shardwise_lightning\s+import\b", re.MULTILINE)


class _UnifiedBuild(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Finds `shardwise_lightning.unified.X` and builds it from `shardwise_lightning.X`'s
    source with `rewrite_imports`."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__:
            return None
        source_spec = importlib.util.find_spec(f"{_SOURCE_PACKAGE}.{name}")
        if source_spec is None or source_spec.origin is None or source_spec.loader is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=source_spec.origin)
        spec.has_location = True  # __file__ is the shared source file
        return spec

    def get_source(self, fullname: str) -> str:
        source_name = f"{_SOURCE_PACKAGE}.{fullname.rpartition('.')[2]}"
        source_spec = importlib.util.find_spec(source_name)
        assert source_spec is not None and isinstance(
            source_spec.loader, importlib.abc.InspectLoader
        )
        source = source_spec.loader.get_source(source_name)
        assert source is not None, source_name
        if _PACKAGE_IMPORT.search(source):
            raise ImportError(
                f"{source_name} imports from the shardwise_lightning package itself, which "
                f"{fullname} cannot rename; import from its submodule instead"
            )
        return rewrite_imports(source)

    def exec_module(self, module: ModuleType) -> None:
        # Compiled from the rewritten text on every import, never cached: a bytecode cache
        # keyed by the shared file name would hold the other build.
        assert module.__spec__ is not None and module.__spec__.origin is not None
        code = compile(
            self.get_source(module.__name__), module.__spec__.origin, "exec", dont_inherit=True
        )
        exec(code, module.__dict__)


if not any(isinstance(finder, _UnifiedBuild) for finder in sys.meta_path):
    sys.meta_path.insert(0, _UnifiedBuild())


def _load(module: str, name: str) -> Any:
    # Typed Any: mypy sees only the pytorch_lightning build of these classes.
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


FullyShardedStrategy: Any = _load("fully_sharded", "FullyShardedStrategy")
GeminiStrategy: Any = _load("gemini", "GeminiStrategy")
ShardwisePrecision: Any = _load("precision", "ShardwisePrecision")
StreamingCheckpointIO: Any = _load("checkpoint_io", "StreamingCheckpointIO")
register_strategies: Any = _load("registry", "register_strategies")

STRATEGY_NAMES: list[str] = register_strategies()

__all__ = [
    "STRATEGY_NAMES",
    "FullyShardedStrategy",
    "GeminiStrategy",
    "ShardwisePrecision",
    "StreamingCheckpointIO",
    "register_strategies",
    "rewrite_imports",
]
