"""Placement of chunks in device and host memory."""

from shardwise.gemini.manager import PLACEMENT_POLICIES, DeviceBudgetExceeded, GeminiManager

__all__ = ["PLACEMENT_POLICIES", "DeviceBudgetExceeded", "GeminiManager"]
