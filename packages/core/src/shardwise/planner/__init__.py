"""Predict memory per rank and choose stage, placement and chunk size before a run."""

from shardwise.planner.activations import (
    ActivationEstimate,
    estimate_activation_bytes,
    estimate_token_activation_bytes,
)
from shardwise.planner.answer import Plan, PlanOption
from shardwise.planner.formulas import StateBytes, engine_bytes, zero_paper_bytes
from shardwise.planner.model_spec import ModelSpec
from shardwise.planner.plan import plan

__all__ = [
    "ActivationEstimate",
    "ModelSpec",
    "Plan",
    "PlanOption",
    "StateBytes",
    "engine_bytes",
    "estimate_activation_bytes",
    "estimate_token_activation_bytes",
    "plan",
    "zero_paper_bytes",
]
