"""`colossalai.nn.optimizer.HybridAdam` / `CPUAdam`, with ColossalAI's argument order and names,
over shardwise's fused Adam (`shardwise.optim`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardwise.optim import hybrid_adam


def _check_colossalai_only(name: str, defaults: dict[str, Any]) -> None:
    if defaults:
        raise TypeError(
            f"{name} got unexpected arguments {sorted(defaults)}; it takes lr, bias_correction, "
            f"betas, eps, weight_decay, adamw_mode, nvme_offload_fraction and nvme_offload_dir"
        )


class HybridAdam(hybrid_adam.HybridAdam):
    """Adam / AdamW over parameters on the device and in host memory (see
    `shardwise.optim.HybridAdam`), taking ColossalAI's arguments in ColossalAI's order.

    Args:
        model_params: parameters or parameter groups.
        lr, bias_correction, betas, eps, weight_decay: as for Adam.
        adamw_mode: decoupled weight decay (AdamW) when True, L2 (Adam) when False.
        nvme_offload_fraction, nvme_offload_dir: the disk tier for the share of optimizer
            state kept in host memory (see `shardwise.optim.HybridAdam`).
        **defaults: refused (ColossalAI ignores them).
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        adamw_mode: bool = True,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
        **defaults: Any,
    ) -> None:
        _check_colossalai_only(type(self).__name__, defaults)
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
            nvme_offload_fraction=nvme_offload_fraction,
            nvme_offload_dir=nvme_offload_dir,
        )


class CPUAdam(HybridAdam):
    """HybridAdam by its other name, as in ColossalAI (the same fused update)."""


__all__ = ["CPUAdam", "HybridAdam"]
