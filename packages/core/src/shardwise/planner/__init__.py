"""Predict memory per rank and choose stage, placement and chunk size before a run."""

from shardwise.planner.formulas import StateBytes, engine_bytes, zero_paper_bytes
from shardwise.planner.plan import ModelSpec, Plan, PlanOption, plan

__all__ = [
    "ModelSpec",
    "Plan",
    "PlanOption",
    "StateBytes",
    "engine_bytes",
    "plan",
    "zero_paper_bytes",
]
