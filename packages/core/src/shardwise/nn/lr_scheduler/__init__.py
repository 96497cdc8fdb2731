"""`colossalai.nn.lr_scheduler`'s path: its schedules, with ColossalAI's signatures (every one
takes `total_steps` second) and numbers."""

from shardwise.nn.lr_scheduler.cosine import (
    CosineAnnealingLR,
    CosineAnnealingWarmupLR,
    FlatAnnealingLR,
    FlatAnnealingWarmupLR,
)
from shardwise.nn.lr_scheduler.linear import LinearWarmupLR
from shardwise.nn.lr_scheduler.multistep import MultiStepLR, MultiStepWarmupLR
from shardwise.nn.lr_scheduler.poly import PolynomialLR, PolynomialWarmupLR
from shardwise.nn.lr_scheduler.torch_named import (
    ExponentialLR,
    LambdaLR,
    MultiplicativeLR,
    OneCycleLR,
    StepLR,
)

__all__ = [
    "CosineAnnealingLR",
    "CosineAnnealingWarmupLR",
    "ExponentialLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
    "LambdaLR",
    "LinearWarmupLR",
    "MultiStepLR",
    "MultiStepWarmupLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "PolynomialLR",
    "PolynomialWarmupLR",
    "StepLR",
]
