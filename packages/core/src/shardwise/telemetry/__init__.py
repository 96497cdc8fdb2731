"""Per-rank telemetry events, a non-blocking emitter, and its sinks."""

from shardwise.telemetry.destination import front_door
from shardwise.telemetry.emitter import TelemetryEmitter
from shardwise.telemetry.events import SCHEMA_VERSION
from shardwise.telemetry.recorder import TelemetryRecorder, enable
from shardwise.telemetry.sinks import HttpSink, JsonlSink

__all__ = [
    "SCHEMA_VERSION",
    "HttpSink",
    "JsonlSink",
    "TelemetryEmitter",
    "TelemetryRecorder",
    "enable",
    "front_door",
]
