"""Placement of chunks in device and host memory."""

from shardwise.gemini.errors import DeviceBudgetExceeded
from shardwise.gemini.manager import GeminiManager
from shardwise.gemini.passes import Pass
from shardwise.gemini.policies import (
    PLACEMENT_POLICIES,
    AutoPlacement,
    DevicePlacement,
    HostPlacement,
    PlacementPolicy,
    StaticPlacement,
    placement_policy,
    replicated,
)
from shardwise.gemini.room import Room
from shardwise.gemini.tracer import MemoryTracer

__all__ = [
    "PLACEMENT_POLICIES",
    "AutoPlacement",
    "DeviceBudgetExceeded",
    "DevicePlacement",
    "GeminiManager",
    "HostPlacement",
    "MemoryTracer",
    "Pass",
    "PlacementPolicy",
    "Room",
    "StaticPlacement",
    "placement_policy",
    "replicated",
]
