"""The device rules every front door leaves to the engine, decided here once: which device a
rank computes on, which dtype it computes in on that device, and whether host copies of chunks
are pinned. (The third rule of devices, what "auto" placement does where no budget can be
read, is `gemini.manager.placement_on`.)"""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """`cuda:<current>` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compute_device(value: object, setting: str = "gemini_config['device']") -> torch.device:
    """The compute device named by `value` (a torch.device or its string), refused with the
    setting to change when this torch cannot compute there (e.g. "cuda" on a CPU-only build)."""
    if value is None:
        return default_device()
    if not isinstance(value, (torch.device, str)):
        raise TypeError(f"{setting} must be a torch.device or a string, got {value!r}")
    try:
        device = torch.device(value)
    except RuntimeError as error:
        raise ValueError(f"{setting} {value!r} is not a device: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{setting} is {str(device)!r} but CUDA is not available here "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False): set {setting} "
            f"to torch.device('cpu'), or leave it out to use cuda when there is one and the CPU "
            f"otherwise; the 'cuda' placement policy then keeps chunks on the CPU"
        )
    return device


def compute_dtype_on(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype forward and backward run in where a run stores its parameters in `dtype` and
    says nothing of its compute dtype: `dtype` on an accelerator, fp32 on a CPU, where 16-bit
    matrix math is tens of times slower (FACTS.md: fp32 33.8 GFLOP/s, bf16/fp16 0.7)."""
    return torch.float32 if device.type == "cpu" else dtype


def pins_host_copies(device: torch.device) -> bool:
    """Whether host copies of chunks are pinned where a front door leaves it to the engine:
    when they feed a CUDA device (page-locked memory is copied to and from it without a
    staging copy); a CPU device has nothing to pin for. The seed front doors that take
    `pin_memory` (GeminiDDP, GeminiPlugin, `gemini_config`) pass theirs instead."""
    return device.type == "cuda"
