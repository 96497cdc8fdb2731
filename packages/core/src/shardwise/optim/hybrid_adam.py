"""Adam and AdamW over parameters wherever they live, on torch's fused kernels.

One fused call per (device, dtypes) group updates parameters, both moments and the step count
in a single pass over memory; the loss-scale and clipping factor is applied inside that same
pass (`grad_scale`), so unscaling costs no pass of its own.

[Note: mixed precision in HybridAdam]
As ColossalAI's HybridAdam / CPUAdam do, a parameter and its gradient need not share a dtype,
and 16-bit parameters keep their moments in fp32:
- fp32 parameter, fp32 gradient: the fused kernel runs in place, nothing is copied.
- fp32 parameter, fp16/bf16 gradient: the gradient is widened to fp32 (exactly: every 16-bit
  value is an fp32 value) and the update is the fp32 update of that gradient.
- fp16/bf16 parameter: its moments are fp32; the update is computed in fp32 from the
  parameter's value (widened exactly) and rounded to nearest into the parameter's dtype.
The widened copies are made a batch of tensors at a time (at most `_WIDEN_BATCH_NUMEL`
elements), so the extra memory is bounded whatever the model's size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch

_STEP_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_WIDEN_BATCH_NUMEL = 1 << 24  # 16M elements: at most 128 MiB of fp32 copies (param and grad)


class HybridAdam(torch.optim.Optimizer):
    """Adam (`adamw_mode=False`, L2 penalty added to the gradient) or AdamW (decoupled weight
    decay), for parameters on any mix of devices: host shards step on the CPU, device shards on
    the device. Parameters may be fp32, fp16 or bf16, and a gradient may be 16-bit under an
    fp32 parameter; moments are kept in fp32 for 16-bit parameters (see [Note: mixed precision
    in HybridAdam]).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decay (decoupled in AdamW mode, L2 otherwise).
        amsgrad: keep the maximum of the second moments.
        adamw_mode: AdamW when True, Adam when False.
        bias_correction: ColossalAI's flag; only True (Adam's bias correction, what the fused
            kernels compute) can be honoured, False is refused.
        nvme_offload_fraction: the share, in [0, 1], of the optimizer sides kept in host
            memory that the engine keeps on the disk tier instead (their fp32 masters and
            this optimizer's state, in files: see [Note: the disk tier] in
            memory/disk_pool.py). Honoured when the engine steps this optimizer
            (`zero_optim_wrapper`, the Booster's ZeRO plugins) with optimizer state in host
            memory ("cpu" placement, `cpu_offload=True`, "static" `offload_optim_frac`);
            refused at the first step otherwise.
        nvme_offload_dir: where those files go (None: the system's temporary directory).
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
        *,
        bias_correction: bool = True,
        nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"betas must each be in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if bias_correction is not True:
            raise ValueError(
                f"bias_correction={bias_correction!r} cannot be honoured: the fused Adam kernels "
                f"always correct the moments' bias; leave bias_correction=True"
            )
        if (
            isinstance(nvme_offload_fraction, bool)
            or not isinstance(nvme_offload_fraction, (int, float))
            or not 0 <= nvme_offload_fraction <= 1
        ):
            raise ValueError(
                f"nvme_offload_fraction must be a number in [0, 1], got {nvme_offload_fraction!r}"
            )
        if nvme_offload_dir is not None and not isinstance(nvme_offload_dir, str):
            raise TypeError(f"nvme_offload_dir must be a str path, got {nvme_offload_dir!r}")
        self.nvme_offload_fraction = float(nvme_offload_fraction)
        self.nvme_offload_dir = nvme_offload_dir
        # Set when the engine takes the NVMe settings over (`claim_nvme_offload`).
        self._nvme_claimed = False
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "adamw_mode": adamw_mode,
            # ColossalAI's HybridAdam and CPUAdam keep it in every group (and read it there).
            "bias_correction": bias_correction,
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
        if self.nvme_offload_fraction > 0 and not self._nvme_claimed:
            raise ValueError(
                f"nvme_offload_fraction={self.nvme_offload_fraction} is honoured only when the "
                f"engine steps this optimizer (zero_optim_wrapper, the Booster's ZeRO plugins) "
                f"with optimizer state in host memory; without it there is no disk tier: leave "
                f"nvme_offload_fraction at 0.0"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("bias_correction", True) is not True:
                raise ValueError(
                    f"a parameter group has bias_correction={group['bias_correction']!r}, which "
                    f"cannot be honoured: the fused Adam kernels always correct the moments' "
                    f"bias; set it True"
                )
            buckets: dict[tuple[torch.device, torch.dtype, torch.dtype], list[torch.Tensor]]
            buckets = defaultdict(list)
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ValueError("HybridAdam does not support sparse gradients")
                _check_pair(param, grad)
                buckets[(param.device, param.dtype, grad.dtype)].append(param)
            for (device, param_dtype, grad_dtype), params in buckets.items():
                if param_dtype == grad_dtype and param_dtype in (torch.float32, torch.float64):
                    grads = [p.grad for p in params if p.grad is not None]
                    self._fused_update(group, params, grads, device, grad_scale)
                else:
                    self._widened_update(group, params, device, grad_scale)
        return loss

    def claim_nvme_offload(self) -> tuple[float, str | None]:
        """The engine stepping this optimizer takes over its NVMe settings (fraction,
        directory), which it then honours."""
        self._nvme_claimed = True
        return self.nvme_offload_fraction, self.nvme_offload_dir

    def _widened_update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        device: torch.device,
        grad_scale: float | None,
    ) -> None:
        """See [Note: mixed precision in HybridAdam]: a batch at a time, widen, step, round."""
        compute = torch.float64 if params[0].dtype == torch.float64 else torch.float32
        batch: list[torch.Tensor] = []
        numel = 0
        for index, param in enumerate(params):
            batch.append(param)
            numel += param.numel()
            if numel < _WIDEN_BATCH_NUMEL and index < len(params) - 1:
                continue
            # A parameter already in the compute dtype is stepped in place.
            work = [p if p.dtype == compute else p.to(compute) for p in batch]
            grads = [p.grad.to(compute) for p in batch if p.grad is not None]
            self._fused_update(group, batch, grads, device, grad_scale, work=work)
            for param_, widened in zip(batch, work, strict=True):
                if widened is not param_:
                    param_.copy_(widened)
            batch, numel = [], 0

    def _fused_update(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        device: torch.device,
        grad_scale: float | None,
        *,
        work: list[torch.Tensor] | None = None,
    ) -> None:
        """The fused kernel over `work` (default: the parameters themselves) and `grads`; the
        state is kept per parameter, in the dtype of `work`."""
        work = params if work is None else work
        states = [
            self._state_of(p, w.dtype, group["amsgrad"]) for p, w in zip(params, work, strict=True)
        ]
        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
        steps = [s["step"] for s in states]
        # The fused kernel reads the step count but leaves counting to its caller.
        torch._foreach_add_(steps, 1)
        scale = None
        if grad_scale is not None and grad_scale != 1.0:
            scale = torch.tensor(grad_scale, dtype=torch.float32, device=device)
        kernel(
            work,
            grads,
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

    def _state_of(
        self, param: torch.Tensor, dtype: torch.dtype, amsgrad: bool
    ) -> dict[str, torch.Tensor]:
        """The parameter's state, its moments in `dtype` (fp32 for a 16-bit parameter)."""
        state: dict[str, torch.Tensor] = self.state[param]
        if not state:
            # A tensor beside the parameter, as the fused kernel wants it.
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(param, dtype=dtype)
        else:
            # torch's load_state_dict casts state to the parameter's dtype: fp32 moments of a
            # 16-bit parameter come back 16-bit, and are widened again here, once.
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                value = state.get(key)
                if value is not None and value.dtype != dtype:
                    state[key] = value.to(dtype)
            if state["step"].dtype != torch.float32 or state["step"].device != param.device:
                state["step"] = state["step"].to(torch.float32).to(param.device)
        return state


def _check_pair(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.dtype not in _STEP_DTYPES or grad.dtype not in _STEP_DTYPES:
        raise TypeError(
            f"HybridAdam steps fp32, fp16, bf16 (and fp64) tensors, got a {param.dtype} "
            f"parameter with a {grad.dtype} gradient"
        )
    if (param.dtype == torch.float64) != (grad.dtype == torch.float64):
        raise TypeError(
            f"a {param.dtype} parameter with a {grad.dtype} gradient: fp64 parameters need fp64 "
            f"gradients (and fp64 gradients an fp64 parameter)"
        )
    if grad.device != param.device:
        raise ValueError(
            f"a gradient on {grad.device} for a parameter on {param.device}: HybridAdam steps "
            f"each parameter where it lives; move the gradient to the parameter's device"
        )
    if grad.shape != param.shape:
        raise ValueError(
            f"a gradient of shape {tuple(grad.shape)} for a parameter of shape {tuple(param.shape)}"
        )


class CPUAdam(HybridAdam):
    """HybridAdam by its other name: the same fused update, used for shards in host memory."""


def torch_adam_group(group: dict[str, Any]) -> dict[str, Any]:
    """A HybridAdam parameter group as torch's Adam carries one: torch's own hyperparameters
    added (as ColossalAI's `get_param_groups_for_saving`), so a checkpoint loaded into
    `torch.optim.Adam` gives back an equal state dict and steps as this one did: decoupled
    weight decay where this group runs AdamW. The kernel flags take torch's defaults (fused
    None where ColossalAI writes False): a loading optimizer keeps its own
    (`IMPLEMENTATION_KEYS` in checkpoint/optimizer_checkpoint.py)."""
    adam = {
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "decoupled_weight_decay": bool(group.get("adamw_mode", False)),
    }
    return {**adam, **group}
