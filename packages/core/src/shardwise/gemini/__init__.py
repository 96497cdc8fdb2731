"""Placement of chunks in device and host memory."""

from shardwise.gemini.errors import DeviceBudgetExceeded
from shardwise.gemini.manager import PLACEMENT_POLICIES, GeminiManager
from shardwise.gemini.tracer import MemoryTracer

__all__ = ["PLACEMENT_POLICIES", "DeviceBudgetExceeded", "GeminiManager", "MemoryTracer"]
