"""ColossalAI's examples/language/llama/benchmark.py (hpcaitech/ColossalAI), its Gemini plans
followed step for step with `shardwise` for `colossalai`: `launch_from_torch()`, the
`GeminiPlugin(precision="bf16", shard_param_frac=..., offload_optim_frac=...,
offload_param_frac=..., tp_size=args.tp, extra_dp_size=args.extra_dp,
enable_fused_normalization=get_accelerator().is_available(), enable_flash_attention=args.xformers,
max_prefetch=..., enable_async_reduce=..., use_fp8=..., fp8_communication=...)` of the
"gemini" plan and the "gemini_auto" plan's (`placement_policy="auto"`,
`warmup_non_model_data_ratio=args.warmup_ratio`), `get_accelerator().manual_seed(42)`, the
random dataset through `plugin.prepare_dataloader(..., shuffle=True, drop_last=True,
seed=42)`, the model built from its config in bf16 inside
`LazyInitContext(default_device=get_accelerator().get_current_device())`, HybridAdam,
`torch.set_default_dtype(torch.bfloat16)` around `booster.boost`, the training loop printing
each step's loss on the last rank, and the memory lines.

What differs, and why:
- The plans of other plugins (fsdp, fsdp_cpu: TorchFSDPPlugin; 3d, 3d_cpu:
  HybridParallelPlugin with pipeline schedules and Shardformer's configs) are left out, with
  their imports (`TorchFSDPPlugin`, `HybridParallelPlugin`, `PipelineGraph`,
  `PipelineGradientCheckpointConfig`): shardwise offers data parallelism only, and those
  names do not exist in it, so the script as written fails at its imports.
- The configs are tiny ("tiny": 2 layers of width 64, a 256-token vocabulary) and sequences
  short (`-l 32`); the example's 7b default does not fit a CPU test.
- `data_utils.RandomDataset`, `model_utils` and `performance_evaluator` (the example's own
  modules beside it) are written here, the evaluator reduced to the step time it reports; the
  profiler context is left out.
- `--tp` above 1 and `--use_fp8` are refused by GeminiPlugin, each with what to use
  instead; `--use_fp8_comm` gathers parameters and reduces gradients in fp8 (where torch
  casts to fp8 on the device).
"""

import argparse
import resource
import time
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM
from transformers.models.llama.configuration_llama import LlamaConfig

import shardwise
from shardwise.accelerator import get_accelerator
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin
from shardwise.cluster import DistCoordinator
from shardwise.lazy import LazyInitContext
from shardwise.nn.optimizer import HybridAdam

warnings.filterwarnings("ignore")

MODEL_CONFIGS = {
    "tiny": LlamaConfig(
        max_position_embeddings=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_size=64,
        vocab_size=256,
    ),
}


class RandomDataset(Dataset):
    def __init__(self, num_samples: int = 1000, max_length: int = 2048, vocab_size: int = 32000):
        self.num_samples = num_samples
        device = get_accelerator().get_current_device()
        self.input_ids = torch.randint(0, vocab_size, (num_samples, max_length), device=device)
        self.attention_mask = torch.ones_like(self.input_ids)

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        return {
            "input_ids": self.input_ids[idx],
            "attention_mask": self.attention_mask[idx],
            "labels": self.input_ids[idx],
        }


def get_model_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class PerformanceEvaluator:
    def __init__(self, ignore_steps: int) -> None:
        self.ignore_steps = ignore_steps
        self.durations: list[float] = []

    def on_step_start(self, step: int) -> None:
        self.step = step
        get_accelerator().synchronize()
        self.start = time.time()

    def on_step_end(self, **kwargs) -> None:
        get_accelerator().synchronize()
        if self.step >= self.ignore_steps:
            self.durations.append(time.time() - self.start)

    def on_fit_end(self, coordinator: DistCoordinator) -> None:
        mean = torch.tensor(sum(self.durations) / max(len(self.durations), 1))
        dist.all_reduce(mean)
        coordinator.print_on_master(f"mean step time {float(mean) / coordinator.world_size:.3f} s")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", type=str, default="tiny")
    parser.add_argument("-p", "--plugin", choices=["gemini", "gemini_auto"], default="gemini")
    parser.add_argument("-b", "--batch_size", type=int, default=2)
    parser.add_argument("-s", "--num_steps", type=int, default=5)
    parser.add_argument("-i", "--ignore_steps", type=int, default=2)
    parser.add_argument("-g", "--grad_checkpoint", action="store_true")
    parser.add_argument("-l", "--max_length", type=int, default=4096)
    parser.add_argument("-w", "--warmup_ratio", type=float, default=0.8)
    parser.add_argument("-x", "--xformers", action="store_true")
    parser.add_argument("--shard_param_frac", type=float, default=1.0)
    parser.add_argument("--offload_optim_frac", type=float, default=0.0)
    parser.add_argument("--offload_param_frac", type=float, default=0.0)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--extra_dp", type=int, default=1)
    parser.add_argument("--disable-async-reduce", action="store_true")
    parser.add_argument("--prefetch_num", type=int, default=0)
    parser.add_argument("--use_fp8_comm", action="store_true", default=False)
    parser.add_argument("--use_fp8", action="store_true", default=False)
    args = parser.parse_args()

    shardwise.launch_from_torch()
    coordinator = DistCoordinator()

    config = MODEL_CONFIGS[args.config]
    if args.plugin == "gemini":
        plugin = GeminiPlugin(
            precision="bf16",
            shard_param_frac=args.shard_param_frac,
            offload_optim_frac=args.offload_optim_frac,
            offload_param_frac=args.offload_param_frac,
            tp_size=args.tp,
            extra_dp_size=args.extra_dp,
            enable_fused_normalization=get_accelerator().is_available(),
            enable_flash_attention=args.xformers,
            max_prefetch=args.prefetch_num,
            enable_async_reduce=not args.disable_async_reduce,
            use_fp8=args.use_fp8,
            fp8_communication=args.use_fp8_comm,
        )
    elif args.plugin == "gemini_auto":
        plugin = GeminiPlugin(
            placement_policy="auto",
            precision="bf16",
            warmup_non_model_data_ratio=args.warmup_ratio,
            tp_size=args.tp,
            extra_dp_size=args.extra_dp,
            enable_fused_normalization=get_accelerator().is_available(),
            max_prefetch=args.prefetch_num,
            enable_async_reduce=not args.disable_async_reduce,
            enable_flash_attention=args.xformers,
            use_fp8=args.use_fp8,
            fp8_communication=args.use_fp8_comm,
        )

    booster = Booster(plugin=plugin)

    dp_size = getattr(plugin, "dp_size", coordinator.world_size)
    get_accelerator().manual_seed(42)
    dataset = RandomDataset(
        num_samples=args.batch_size * args.num_steps * dp_size,
        max_length=args.max_length,
        vocab_size=config.vocab_size,
    )
    dataloader = plugin.prepare_dataloader(
        dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, seed=42
    )

    init_ctx = (
        LazyInitContext(default_device=get_accelerator().get_current_device())
        if isinstance(plugin, GeminiPlugin)
        else nullcontext()
    )
    with init_ctx:
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=True, torch_dtype=torch.bfloat16
        )
    if args.grad_checkpoint:
        model.gradient_checkpointing_enable()

    coordinator.print_on_master(f"Model params: {get_model_numel(model)}")
    performance_evaluator = PerformanceEvaluator(args.ignore_steps)

    optimizer = HybridAdam(model.parameters())
    torch.set_default_dtype(torch.bfloat16)
    model, optimizer, _, dataloader, _ = booster.boost(model, optimizer, dataloader=dataloader)
    torch.set_default_dtype(torch.float)
    device_mb = get_accelerator().max_memory_allocated() / 1024**2
    coordinator.print_on_master(f"Booster init max device memory: {device_mb:.2f} MB")
    cpu_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    coordinator.print_on_master(f"Booster init max CPU memory: {cpu_mb:.2f} MB")

    for step, batch in enumerate(dataloader):
        performance_evaluator.on_step_start(step)
        outputs = model(**batch)
        loss = outputs[0]
        del outputs
        if dist.get_rank() == dist.get_world_size() - 1:
            print(f"Step {step} loss: {loss}", flush=True)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        performance_evaluator.on_step_end(**batch)
    performance_evaluator.on_fit_end(coordinator)
    coordinator.print_on_master(
        f"Max device memory usage: {get_accelerator().max_memory_allocated() / 1024**2:.2f} MB"
    )


if __name__ == "__main__":
    main()
