"""The engines the benchmarks compare, built over one model: torch's and shardwise's.

An engine is named as the results name it: `ddp`, `fsdp1`, `fsdp2`, `colo` (shardwise's
ColoDDP, stage 0, its defaults), `zero1`, `zero2`, `zero3-cuda`, `zero3-cpu`, and `local`
(plain torch with no communication at all: each rank trains its own copy on its part of the
batch, the floor every engine's step sits on), with suffixes `+sync` (stages 1-2:
`overlap_param_gather=False`, the all-gather of updated parameters waited in the step instead
of overlapping the next forward, the default), `+defaults` (the sizes a user gets: stage 3
searches its chunk size, stages 1-2 take the default reduce_bucket_size), `+compile` (each
block `torch.compile`d before wrapping), `+telemetry` (stream telemetry to a file),
`+offload` (stages 1-2: `cpu_offload`, the optimizer side in host memory), `+int8` / `+fp8`
(parameters gathered and gradients reduced in that quantized format), `+wholestep` (the
optimizer steps every shard in one call, as before the step went chunk by chunk: the
reference of that change), `+pool` (stages 1-3 with `host_buffer_pool=True`: the chunk-sized
buffers a step frees kept for the next ones), `+early` (stage 3 with `step_in_backward=True`:
each chunk steps during backward as its gradient is reduced) and `-rs`, `-a2a`,
`-ar` (shardwise's gradient_reduction: gloo's reduce-scatter, all-to-all, all-reduce).
`zero3-disk` is stage 3 with "cpu" placement and every master and optimizer state on the disk
tier (under `$SHARDWISE_BENCH_DISK_DIR`, else the system's temporary directory).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardwise import zero_model_wrapper, zero_optim_wrapper
from shardwise.testing import GPT, GPTConfig

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Counters = Callable[[], dict[str, float]]

TORCH_ENGINES = ("ddp", "fsdp1", "fsdp2", "local")
ZERO_ENGINES = ("zero1", "zero2", "zero3")
COLO_ENGINE = "colo"
# Engine-name suffixes of the gradient_reduction methods ("auto" is all-to-all on gloo).
# `+int8` / `+fp8`: stages 1-3 gather parameters and reduce gradients in that blockwise format
# (gemini_config's gather_format and reduce_format; README, "Quantized communication").
WIRE_KINDS = ("int8", "fp8")
REDUCTION_SUFFIX = {"auto": "", "reduce_scatter": "-rs", "all_to_all": "-a2a", "all_reduce": "-ar"}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmarked GPT's shape, global batch and chunk size, as command-line options."""
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--chunk-mib", type=float, default=8.0, help="chunk / bucket size")
    parser.add_argument(
        "--untied", action="store_true", help="an output head of its own (not the embedding)"
    )


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        tie_weights=not args.untied,
    )


@dataclass(frozen=True)
class EngineSpec:
    engine: str
    placement: str = "cuda"
    param_gather: bool = True
    reduction: str = "auto"
    telemetry: bool = False
    defaults: bool = False
    compiled: bool = False
    offload: bool = False
    whole_step: bool = False
    wire: str = "dtype"
    pool: bool = False
    early: bool = False

    @property
    def name(self) -> str:
        return (
            self.engine
            + ("-" + self.placement if self.engine == "zero3" else "")
            + ("+offload" if self.offload else "")
            + ("" if self.wire == "dtype" else f"+{self.wire}")
            + ("+wholestep" if self.whole_step else "")
            + ("+pool" if self.pool else "")
            + ("+early" if self.early else "")
            + ("+compile" if self.compiled else "")
            + ("+defaults" if self.defaults else "")
            + ("+telemetry" if self.telemetry else "")
            + ("" if self.param_gather else "+sync")
            + REDUCTION_SUFFIX[self.reduction]
        )

    @classmethod
    def parse(cls, name: str) -> EngineSpec:
        """The spec whose `name` is `name` (e.g. "zero2+sync", "zero3-cpu", "zero2-rs")."""
        original, reduction = name, "auto"
        for method, suffix in REDUCTION_SUFFIX.items():
            if suffix and name.endswith(suffix):
                reduction, name = method, name[: -len(suffix)]
        param_gather = not name.endswith("+sync")
        name = name.removesuffix("+sync")
        telemetry = name.endswith("+telemetry")
        name = name.removesuffix("+telemetry")
        defaults = name.endswith("+defaults")
        name = name.removesuffix("+defaults")
        compiled = name.endswith("+compile")
        name = name.removesuffix("+compile")
        early = name.endswith("+early")
        name = name.removesuffix("+early")
        pool = name.endswith("+pool")
        name = name.removesuffix("+pool")
        whole_step = name.endswith("+wholestep")
        name = name.removesuffix("+wholestep")
        wire = "dtype"
        for kind in WIRE_KINDS:
            if name.endswith(f"+{kind}"):
                wire, name = kind, name.removesuffix(f"+{kind}")
        offload = name.endswith("+offload")
        name = name.removesuffix("+offload")
        engine, _, placement = name.partition("-")
        known = (*TORCH_ENGINES, COLO_ENGINE, *ZERO_ENGINES)
        if engine not in known:
            raise ValueError(f"unknown engine {engine!r}; one of {known}")
        spec = cls(
            engine,
            placement or "cuda",
            param_gather,
            reduction,
            telemetry,
            defaults,
            compiled,
            offload,
            whole_step,
            wire,
            pool,
            early,
        )
        if spec.name != original:
            raise ValueError(f"cannot parse engine name {original!r} (read as {spec.name!r})")
        return spec


def torch_step(module: torch.nn.Module) -> Step:
    """A plain torch training step over `module` (DDP or FSDP wrapped), fused AdamW."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, fused=True)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        _, loss = module(idx, targets)
        loss.backward()
        optimizer.step()
        loss_value: torch.Tensor = loss
        return loss_value

    return step


def build(spec: EngineSpec, model: GPT, chunk_mib: float = 8.0) -> tuple[Step, Counters]:
    """The engine's step function over `model`, and a function returning its counters. With
    `+compile`, each block of the model is `torch.compile`d (inductor) before the engine wraps
    it, as torchtitan compiles a model it shards."""
    if spec.compiled:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = torch.compile(block)
    if spec.engine == "ddp":
        return torch_step(torch.nn.parallel.DistributedDataParallel(model)), dict
    if spec.engine == "local":
        return torch_step(model), dict
    if spec.engine == COLO_ENGINE:
        from shardwise import ColoDDP

        colo = ColoDDP(model)
        return torch_step(colo), lambda: {"sent_bytes": colo.comm_stats.sent_bytes()}
    if spec.engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from shardwise.testing.gpt import Block

        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu")
        )
        return torch_step(wrapped), dict
    if spec.engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return torch_step(model), dict
    return _zero_step(spec, model, chunk_mib)


def whole_step(
    self: Any,
    coef: float,
    grads: list[torch.Tensor | None],
    got_grad: list[bool],
    stepped_early: set[int],
) -> None:
    """The optimizer step as it was before it went chunk by chunk (see [Note: the step, chunk
    by chunk] in engine/optimizer.py): one inner step over every shard, then every publish."""
    from shardwise.optim import HybridAdam

    assert not stepped_early, "+wholestep steps nothing during backward"
    read: list[torch.Tensor] = [
        grad if grad is not None else chunk.grads.for_step()
        for chunk, grad in zip(self._chunks, grads, strict=True)
    ]
    for chunk, grad in zip(self._chunks, read, strict=True):
        for view, begin, end, position in self._slots[chunk.chunk_id]:
            view.grad = grad[begin:end] if got_grad[position] else None

    if isinstance(self.optim, HybridAdam):
        self.optim.step(grad_scale=1.0 / coef)
    else:
        if coef != 1.0:
            torch._foreach_mul_(read, coef)
        self.optim.step()
    for chunk in self._chunks:
        chunk.publish_master(wait=not self.model.config.defers_param_gather)
        chunk.grads.end_step()


def _zero_step(spec: EngineSpec, model: GPT, chunk_mib: float) -> tuple[Step, Counters]:
    stage = int(spec.engine[-1])
    chunk_numel = int(chunk_mib * 2**20 / 4)
    config: dict[str, object] = {
        "device": torch.device("cpu"),
        "gradient_reduction": spec.reduction,
        "gather_format": spec.wire,
        "reduce_format": spec.wire,
    }
    if spec.pool:
        config["host_buffer_pool"] = True
    if stage == 3:
        config.update(placement_policy="cpu" if spec.placement == "disk" else spec.placement)
        if spec.placement == "disk":
            config.update(
                nvme_offload_fraction=1.0,
                nvme_offload_dir=os.environ.get("SHARDWISE_BENCH_DISK_DIR"),
            )
        if not spec.defaults:
            config.update(chunk_size_numel=chunk_numel)
    wrapped = zero_model_wrapper(model, stage, config)
    zero_optimizer = zero_optim_wrapper(
        wrapped,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        optim_config=(
            {"overlap_param_gather": spec.param_gather, "cpu_offload": spec.offload}
            | ({} if spec.defaults else {"reduce_bucket_size": chunk_numel})
            if stage < 3
            else None
        ),
        step_in_backward=spec.early or None,
    )
    if spec.whole_step:
        zero_optimizer._step_chunk_by_chunk = types.MethodType(  # type: ignore[method-assign]
            whole_step, zero_optimizer
        )
    recorder = None
    if spec.telemetry:
        from shardwise import telemetry

        scratch = tempfile.mkdtemp(prefix="shardwise-telemetry-")
        recorder = telemetry.enable(
            wrapped, zero_optimizer, path=f"{scratch}/events", run_id="bench"
        )

    def zero_step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        zero_optimizer.zero_grad()
        _, loss = wrapped(idx, targets)
        zero_optimizer.backward(loss)
        zero_optimizer.step()
        return loss

    def counters() -> dict[str, float]:
        moved = wrapped.gemini_manager.bytes_moved() if wrapped.gemini_manager else {}
        return {
            # Copies between the pools (host<->device, from the disk tier and to it).
            **{f"moved_{key}": float(value) for key, value in moved.items()},
            "sent_bytes": wrapped.comm_stats.sent_bytes(),
            "model_state_bytes": sum(wrapped.memory_report().values())
            + zero_optimizer.state_bytes(),
            "telemetry_cpu_s": recorder.cpu_seconds() if recorder is not None else 0.0,
        }

    return zero_step, counters
