"""Which of Lightning's two namespaces this copy of the package is built on.

This module is one of the sources that `shardwise_lightning.unified` loads a second time with
its Lightning imports renamed (see [Note: two Lightning namespaces] there): under
`shardwise_lightning` it reads `pytorch_lightning`, under `shardwise_lightning.unified`
`lightning.pytorch`, and it names the other one in the errors a user gets for mixing them.
"""

from __future__ import annotations

import pytorch_lightning as trainer_package

# "pytorch_lightning", or "lightning.pytorch" in the copy under shardwise_lightning.unified.
TRAINER_PACKAGE: str = trainer_package.__name__
# Where this copy's classes are imported from: "shardwise_lightning" or its ".unified".
PACKAGE: str = __name__.rpartition(".")[0]
_COUNTERPARTS = {
    "pytorch_lightning": ("lightning.pytorch", "shardwise_lightning.unified"),
    "lightning.pytorch": ("pytorch_lightning", "shardwise_lightning"),
}
OTHER_TRAINER_PACKAGE, OTHER_PACKAGE = _COUNTERPARTS[TRAINER_PACKAGE]


def namespace_of(value: object) -> str | None:
    """The Lightning namespace `value`'s class is built on ("pytorch_lightning" or
    "lightning.pytorch"), or None for a class of neither."""
    for cls in type(value).__mro__:
        root = cls.__module__.partition(".")[0]
        if root in ("pytorch_lightning", "lightning_fabric"):
            return "pytorch_lightning"
        if root == "lightning":
            return "lightning.pytorch"
    return None


def describe(value: object) -> str:
    """The repr of a shardwise Lightning object: its class, the namespace it is built for and
    where its counterpart for the other one lives. Lightning's Trainer quotes it when it
    refuses a strategy or plugin of the other namespace, so that error names the fix."""
    name = type(value).__name__
    return (
        f"<{name} for {TRAINER_PACKAGE}.Trainer; for {OTHER_TRAINER_PACKAGE}.Trainer use "
        f"{OTHER_PACKAGE}.{name}>"
    )


def check_namespace(argument: str, value: object, owner: str) -> None:
    """Refuse `value` (passed as `argument` to `owner`) when it is built on the other Lightning
    namespace, whose objects this copy's Trainer cannot use."""
    if value is None or namespace_of(value) != OTHER_TRAINER_PACKAGE:
        return
    raise TypeError(
        f"{owner} is built on {TRAINER_PACKAGE}, but {argument} is a {type(value).__name__} "
        f"built on {OTHER_TRAINER_PACKAGE}; use one Lightning for all of them: with "
        f"{TRAINER_PACKAGE}.Trainer import Lightning's classes from {TRAINER_PACKAGE} and ours "
        f"from {PACKAGE}, with {OTHER_TRAINER_PACKAGE}.Trainer ours from {OTHER_PACKAGE}"
    )


def check_namespaces(owner: str, **arguments: object) -> None:
    """`check_namespace` for each of `owner`'s keyword `arguments`."""
    for argument, value in arguments.items():
        check_namespace(argument, value, owner)
