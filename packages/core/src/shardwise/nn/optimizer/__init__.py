"""`colossalai.nn.optimizer.HybridAdam` / `CPUAdam`, with ColossalAI's argument order and names,
over shardwise's fused Adam (`shardwise.optim`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardwise.optim import hybrid_adam


def _check_colossalai_only(
    name: str, nvme_offload_fraction: float, nvme_offload_dir: str | None, defaults: dict[str, Any]
) -> None:
    if nvme_offload_fraction != 0.0 or nvme_offload_dir is not None:
        raise ValueError(
            f"{name}: NVMe offload (nvme_offload_fraction={nvme_offload_fraction}, "
            f"nvme_offload_dir={nvme_offload_dir!r}) is not offered; optimizer state lives on the "
            f"device or in host memory (GeminiPlugin's offload_optim_frac places it)"
        )
    if defaults:
        raise TypeError(
            f"{name} got unexpected arguments {sorted(defaults)}; it takes lr, bias_correction, "
            f"betas, eps, weight_decay and adamw_mode"
        )


class HybridAdam(hybrid_adam.HybridAdam):
    """Adam / AdamW over parameters on the device and in host memory (see
    `shardwise.optim.HybridAdam`), taking ColossalAI's arguments in ColossalAI's order.

    Args:
        model_params: parameters or parameter groups.
        lr, bias_correction, betas, eps, weight_decay: as for Adam.
        adamw_mode: decoupled weight decay (AdamW) when True, L2 (Adam) when False.
        nvme_offload_fraction, nvme_offload_dir: NVMe offload, not offered: only the defaults
            (0.0, None) are accepted.
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
        _check_colossalai_only(
            type(self).__name__, nvme_offload_fraction, nvme_offload_dir, defaults
        )
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )


class CPUAdam(HybridAdam):
    """HybridAdam by its other name, as in ColossalAI (the same fused update)."""


__all__ = ["CPUAdam", "HybridAdam"]
