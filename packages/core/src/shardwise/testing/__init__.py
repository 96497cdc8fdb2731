"""Helpers for testing and benchmarking shardwise: forked multi-rank runs and a toy GPT; and
the helpers ColossalAI's tests use (`colossalai.testing`'s path)."""

from shardwise.testing.decorators import (
    clear_cache_before_run,
    parameterize,
    rerun_if_address_is_in_use,
    rerun_on_exception,
)
from shardwise.testing.gpt import GPT, GPTConfig, gpt_batch
from shardwise.testing.ranks import RankFailure, run_ranks
from shardwise.testing.spawn import free_port, spawn

__all__ = [
    "GPT",
    "GPTConfig",
    "RankFailure",
    "clear_cache_before_run",
    "free_port",
    "gpt_batch",
    "parameterize",
    "rerun_if_address_is_in_use",
    "rerun_on_exception",
    "run_ranks",
    "spawn",
]
