"""Shard strategies: how a model's parameters are grouped into chunks, hence collectives."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn


class BaseShardStrategy:
    """Groups parameters into chunks; each group becomes its own chunk(s)."""

    def groups(self, module: nn.Module) -> Iterator[list[tuple[str, nn.Parameter]]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TensorShardStrategy(BaseShardStrategy):
    """Every parameter in a chunk of its own: one all-gather per tensor."""

    def groups(self, module: nn.Module) -> Iterator[list[tuple[str, nn.Parameter]]]:
        for name, param in module.named_parameters():
            yield [(name, param)]


class BucketTensorShardStrategy(BaseShardStrategy):
    """All parameters a module owns directly in one chunk: one all-gather per module."""

    def groups(self, module: nn.Module) -> Iterator[list[tuple[str, nn.Parameter]]]:
        seen: set[int] = set()
        for prefix, submodule in module.named_modules():
            group = []
            for name, param in submodule.named_parameters(recurse=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    group.append((f"{prefix}.{name}" if prefix else name, param))
            if group:
                yield group
