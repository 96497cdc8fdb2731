"""The test decorators ColossalAI's tests use and users copy (`colossalai.testing`):
`parameterize`, `rerun_on_exception`, `rerun_if_address_is_in_use`, `clear_cache_before_run`."""

from __future__ import annotations

import functools
import gc
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch.multiprocessing.spawn import ProcessRaisedException

F = TypeVar("F", bound=Callable[..., Any])


def parameterize(argument: str, values: Sequence[Any]) -> Callable[[F], F]:
    """Call the decorated function once per value of `argument` (stacked decorators run every
    combination, the outer one varying slowest). Unlike pytest's, the calls run inside one
    test, so a multi-rank test sweeps its cases in one group of ranks.

    Args:
        argument: the keyword the values are passed as.
        values: the values, in order.
    """

    def wrap(func: F) -> F:
        @functools.wraps(func)
        def each(*args: Any, **kwargs: Any) -> None:
            for value in values:
                func(*args, **{**kwargs, argument: value})

        return each  # type: ignore[return-value]

    return wrap


def rerun_on_exception(
    exception_type: type[BaseException] = Exception, pattern: str | None = None, max_try: int = 5
) -> Callable[[F], F]:
    """Run the decorated function again, up to `max_try` times in all, when it raises
    `exception_type` whose message has a line matching `pattern` (any message when None).

    Args:
        exception_type: the exception to retry on.
        pattern: a regular expression a line of the message must match.
        max_try: runs at most.
    """
    if isinstance(max_try, bool) or not isinstance(max_try, int) or max_try < 1:
        raise ValueError(f"max_try must be a positive int, got {max_try!r}")

    def wrap(func: F) -> F:
        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(1, max_try + 1):
                try:
                    return func(*args, **kwargs)
                except exception_type as error:
                    lines = str(error).splitlines()
                    matches = pattern is None or any(re.match(pattern, line) for line in lines)
                    if attempt == max_try or not matches:
                        raise
            raise AssertionError("unreachable")

        run.__signature__ = inspect.signature(func)  # type: ignore[attr-defined]  # pytest reads it
        return run  # type: ignore[return-value]

    return wrap


def rerun_if_address_is_in_use() -> Callable[[F], F]:
    """Run the decorated `spawn`ing test again when a rank failed with "address already in
    use" (a port taken between choosing it and binding it)."""
    return rerun_on_exception(ProcessRaisedException, pattern=".*(A|a)ddress already in use.*")


def clear_cache_before_run() -> Callable[[F], F]:
    """Collect garbage, and on CUDA empty the cache and reset the peak memory counters, before
    each call of the decorated function."""

    def wrap(func: F) -> F:
        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            return func(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
