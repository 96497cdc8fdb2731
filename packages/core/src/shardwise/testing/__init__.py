"""Helpers for testing and benchmarking shardwise: forked multi-rank runs and a toy GPT."""

from shardwise.testing.gpt import GPT, GPTConfig, gpt_batch
from shardwise.testing.ranks import RankFailure, run_ranks

__all__ = ["GPT", "GPTConfig", "RankFailure", "gpt_batch", "run_ranks"]
