"""ColossalAI's examples/language/gpt/gemini/train_gpt_demo.py (hpcaitech/ColossalAI), followed
step for step with `shardwise` for `colossalai`: `disable_existing_loggers()` and
`launch_from_torch()`, `get_dist_logger()` logging on rank 0, the GPT criterion, the model
built in `LazyInitContext(default_device=get_accelerator().get_current_device())` for Gemini,
`LowLevelZeroPlugin(stage=..., reduce_bucket_size_in_m=12, overlap_communication=True,
verbose=True)` for CAI_ZeRO1/2 and `GeminiPlugin(search_range_m=128,
hidden_dim=model.config.n_embd)` for CAI_Gemini, HybridAdam, `booster.boost(model, optimizer,
criterion)`, and the timed steps with their memory lines.

What differs, and why:
- The model zoo's `gpt2_medium` (`commons.model_zoo`, with activation checkpointing) is a tiny
  GPT-2 from a config, with transformers' gradient checkpointing, and the sequences are 32
  tokens of a 128-token vocabulary (the example: 1024 of 50257); `commons.utils.get_data` and
  `get_tflops` are written here; the profiler context is left out.
- `torch.cuda.synchronize()` and `torch.cuda.memory_allocated()` are the accelerator's
  `synchronize()` and `memory_allocated()`: torch's raise without CUDA.
- The version check (`colossalai.__version__ >= 0.2.0`) reads shardwise's version, which is
  numbered on its own: it is left out. `set_cpu_maximum_parallelism()` (it sets
  OMP_NUM_THREADS to the machine's cores after torch has started) is left out: the test's two
  ranks share two cores.
- The Pytorch_DDP / Pytorch_ZeRO plans (`args.tp_degree`, an argument the example never
  defines) are left out.
- Each step logs `Loss:<l>` on rank 0 as the example does; the test reads them.
"""

import argparse
from contextlib import nullcontext
from functools import partial
from time import time

import psutil
import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel

import shardwise
from shardwise.accelerator import get_accelerator
from shardwise.booster import Booster
from shardwise.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
from shardwise.lazy import LazyInitContext
from shardwise.logging import disable_existing_loggers, get_dist_logger
from shardwise.nn.optimizer import HybridAdam


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--distplan", type=str, default="CAI_Gemini")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--model_type", type=str, default="gpt2_tiny")
    parser.add_argument("--train_step", type=int, default=10)
    return parser.parse_args()


class GPTLMModel(nn.Module):
    def __init__(self, checkpoint=False):
        super().__init__()
        self.config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=128)
        self.model = GPT2LMHeadModel(self.config)
        if checkpoint:
            self.model.gradient_checkpointing_enable()

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]


def model_builder(model_type):
    assert model_type == "gpt2_tiny", model_type
    return GPTLMModel


class GPTLMLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, logits, labels):
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss_fn(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def get_data(batch_size, seq_len, vocab_size):
    device = get_accelerator().get_current_device()
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
    return input_ids, torch.ones_like(input_ids)


def get_tflops(model_numel, batch_size, seq_len, step_time):
    return model_numel * batch_size * seq_len * 8 / 1e12 / (step_time + 1e-12)


def get_cpu_mem():
    return psutil.Process().memory_info().rss / 1024**2


def get_gpu_mem():
    return get_accelerator().memory_allocated() / 1024**2


def get_mem_info(prefix=""):
    gpu, cpu = get_gpu_mem(), get_cpu_mem()
    return f"{prefix}GPU memory usage: {gpu:.2f} MB, CPU memory usage: {cpu:.2f} MB"


def get_model_size(model: nn.Module):
    return sum(p.numel() for module in model.modules() for p in module.parameters(recurse=False))


def main():
    args = parse_args()
    if args.distplan not in ["CAI_ZeRO1", "CAI_ZeRO2", "CAI_Gemini"]:
        raise TypeError(f"{args.distplan} is error")

    BATCH_SIZE = args.batch_size
    SEQ_LEN = 32
    VOCAB_SIZE = 128
    NUM_STEPS = args.train_step
    WARMUP_STEPS = 1
    assert WARMUP_STEPS < NUM_STEPS, "warmup steps should smaller than the total steps"
    assert (NUM_STEPS - WARMUP_STEPS) % 2 == 1, (
        "the number of valid steps should be odd to take the median"
    )

    disable_existing_loggers()
    shardwise.launch_from_torch()

    logger = get_dist_logger()
    logger.info(f"{args.model_type}, {args.distplan}, batch size {BATCH_SIZE}", ranks=[0])

    criterion = GPTLMLoss()
    torch.manual_seed(123)
    ctx = (
        LazyInitContext(default_device=get_accelerator().get_current_device())
        if args.distplan == "CAI_Gemini"
        else nullcontext()
    )
    with ctx:
        model = model_builder(args.model_type)(checkpoint=True)

    zero_stage = {"CAI_ZeRO1": 1, "CAI_ZeRO2": 2, "CAI_Gemini": 3}[args.distplan]
    if args.distplan.startswith("CAI_ZeRO"):
        plugin = LowLevelZeroPlugin(
            stage=zero_stage, reduce_bucket_size_in_m=12, overlap_communication=True, verbose=True
        )
    else:
        plugin = GeminiPlugin(search_range_m=128, hidden_dim=model.config.n_embd)

    optimizer = HybridAdam(model.parameters(), lr=1e-3)
    logger.info(get_mem_info(prefix="After init optim, "), ranks=[0])

    booster = Booster(plugin=plugin)
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)

    numel = get_model_size(model)
    logger.info(f"the size of testing model size is {numel}.")
    logger.info(get_mem_info(prefix="After init model, "), ranks=[0])
    get_tflops_func = partial(get_tflops, numel, BATCH_SIZE, SEQ_LEN)

    get_accelerator().synchronize()
    model.train()
    tflops_list = []

    for n in range(NUM_STEPS):
        input_ids, attn_mask = get_data(BATCH_SIZE, SEQ_LEN, VOCAB_SIZE)
        optimizer.zero_grad()
        start = time()
        outputs = model(input_ids, attn_mask)
        loss = criterion(outputs, input_ids)
        get_accelerator().synchronize()
        fwd_end = time()
        logger.info(get_mem_info(prefix=f"[{n + 1}/{NUM_STEPS}] Forward "), ranks=[0])
        booster.backward(loss, optimizer)
        get_accelerator().synchronize()
        bwd_end = time()
        optimizer.step()
        get_accelerator().synchronize()
        step_time = time() - start
        logger.info(
            f"[{n + 1}/{NUM_STEPS}] Loss:{loss.item():.3f}, Step time: {step_time:.3f}s, "
            f"FWD time: {fwd_end - start:.3f}s, BWD time: {bwd_end - fwd_end:.3f}s",
            ranks=[0],
        )
        if n >= WARMUP_STEPS:
            tflops_list.append(get_tflops_func(step_time))

    tflops_list.sort()
    median_index = ((NUM_STEPS - WARMUP_STEPS) >> 1) + WARMUP_STEPS
    logger.info(f"Median TFLOPS is {tflops_list[median_index]:.6f}")
    get_accelerator().synchronize()


if __name__ == "__main__":
    main()
