"""Predict memory per rank and choose stage, placement and chunk size before a run."""

from shardwise.planner.answer import Plan, PlanOption
from shardwise.planner.formulas import StateBytes, engine_bytes, zero_paper_bytes
from shardwise.planner.model_spec import ModelSpec
from shardwise.planner.plan import plan

__all__ = [
    "ModelSpec",
    "Plan",
    "PlanOption",
    "StateBytes",
    "engine_bytes",
    "plan",
    "zero_paper_bytes",
]
