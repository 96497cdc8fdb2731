"""`get_current_device` and `set_seed`, as ColossalAI's `colossalai.utils` has them."""

from __future__ import annotations

import random

import numpy as np
import torch

from shardwise.accelerator import get_accelerator


def get_current_device() -> torch.device:
    """The device this process computes on: `cuda:<current>`, or the CPU."""
    return get_accelerator().get_current_device()


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every device's) with `seed`.

    Args:
        seed: the seed.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device's generator too
