"""Adam and AdamW over parameters wherever they live, on torch's fused kernels.

One fused call per (device, dtype) group updates parameters, both moments and the step count
in a single pass over memory; the loss-scale and clipping factor is applied inside that same
pass (`grad_scale`), so unscaling costs no pass of its own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch


class HybridAdam(torch.optim.Optimizer):
    """Adam (`adamw_mode=False`, L2 penalty added to the gradient) or AdamW (decoupled weight
    decay), for parameters on any mix of devices: host shards step on the CPU, device shards on
    the device.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decay (decoupled in AdamW mode, L2 otherwise).
        amsgrad: keep the maximum of the second moments.
        adamw_mode: AdamW when True, Adam when False.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"betas must each be in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "adamw_mode": adamw_mode,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, *, grad_scale: float | None = None
    ) -> float | None:
        """One update of every parameter with a gradient.

        Args:
            closure: re-evaluates the model and returns the loss.
            grad_scale: gradients are divided by this inside the fused pass (the loss scale
                over the clipping coefficient); None leaves them as they are.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError("HybridAdam does not support sparse gradients")
                buckets[(param.device, param.dtype)].append(param)
            for (device, _), params in buckets.items():
                self._fused_update(group, params, device, grad_scale)
        return loss

    def _fused_update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        device: torch.device,
        grad_scale: float | None,
    ) -> None:
        states = [self._state_of(p, group["amsgrad"]) for p in params]
        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
        steps = [s["step"] for s in states]
        # The fused kernel reads the step count but leaves counting to its caller.
        torch._foreach_add_(steps, 1)
        scale = None
        if grad_scale is not None and grad_scale != 1.0:
            scale = torch.tensor(grad_scale, dtype=torch.float32, device=device)
        kernel(
            params,
            [p.grad for p in params if p.grad is not None],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],
            steps,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=group["amsgrad"],
            maximize=False,
            grad_scale=scale,
            found_inf=None,
        )

    def _state_of(self, param: torch.Tensor, amsgrad: bool) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = self.state[param]
        if not state:
            # A tensor beside the parameter, as the fused kernel wants it.
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(
                    param, memory_format=torch.preserve_format
                )
        return state


class CPUAdam(HybridAdam):
    """HybridAdam by its other name: the same fused update, used for shards in host memory."""
