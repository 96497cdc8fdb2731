"""The user's module wrapped for ZeRO: chunks, gradient hooks and, at stage 3, gather hooks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_map

from shardwise import comm
from shardwise.chunk import ChunkManager
from shardwise.chunk.manager import ChunkPlacer
from shardwise.comm import CommStats
from shardwise.engine.build import chunk_manager_for
from shardwise.engine.config import EngineConfig
from shardwise.engine.module_at_rest import ModuleAtRest, ModuleState
from shardwise.engine.packing import Packing, place_buffers
from shardwise.engine.state_dict import gather_full_grads, load_full_state_dict
from shardwise.gemini import GeminiManager
from shardwise.prepare.meta_init import MetaMaterializer, has_meta_tensors
from shardwise.runtime.gather_scheduler import GatherScheduler
from shardwise.runtime.grad_reducer import GradReducer
from shardwise.runtime.hooks import HookSet
from shardwise.runtime.param_gather import DeferredParamGather
from shardwise.runtime.rank_sync import RankSync, VisitTrail
from shardwise.runtime.runtime import Runtime
from shardwise.runtime.unit_plan import compiled

# Set on a module once an engine has taken over its parameters: wrapping it again would pack
# chunk views into new chunks (at stage 3, empty placeholders).
_WRAPPED_MARK = "_shardwise_wrapped"


class ZeroModel(nn.Module):
    """A module whose parameters live in chunks, with gradients reduced over ranks.

    Stage 1 keeps whole gradients: in fp32 averaged over the ranks during backward, as DDP
    does, `.grad` viewing them (see [Note: stage 1 averages in backward] in chunk/grads.py),
    otherwise local until the optimizer step reduces them; stage 2 reduce-scatters each chunk
    of gradients during backward and keeps only this rank's slice; stage 3 also shards the
    parameters, gathering each chunk just before the modules that use it run. Use it with a
    `ZeroOptimizer` (see `zero_optim_wrapper`), which owns the sharded fp32 master weights.

    Args:
        module: the model; it is moved to `config.device`, and its parameters become views of
            chunk buffers (the parameter objects stay the same, so an optimizer built over
            `module.parameters()` can be wrapped afterwards).
        config: stage, dtypes, chunk size and process group.
        chunk_manager: an empty chunk manager to pack the parameters into (built from
            `config` when not given).
        gemini_manager: stage 3's placement of chunks in device and host memory, over
            `chunk_manager`; without one every buffer stays on the device (stages 1-2 make
            their own when `config` offloads the optimizer side: see [Note: offload at stages
            1 and 2] in engine/packing.py).
    """

    def __init__(
        self,
        module: nn.Module,
        config: EngineConfig,
        chunk_manager: ChunkManager | None = None,
        gemini_manager: GeminiManager | None = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, ZeroModel):
            raise ValueError("module is already wrapped by shardwise; wrap the inner module once")
        if getattr(module, _WRAPPED_MARK, False):
            raise ValueError(
                f"{type(module).__name__} was already wrapped by shardwise: its parameters are "
                f"views of another engine's chunks. Use the model the first wrapper returned, or "
                f"build a fresh module to wrap again"
            )
        if config.stage == 0:
            raise ValueError("stage 0 (plain data parallel) is ColoDDP; use ColoDDP(module)")
        comm.check_launched_group(config.topology.process_group)
        super().__init__()
        object.__setattr__(module, _WRAPPED_MARK, True)
        comm.destroy_default_group_at_exit()  # see [Note: gloo at exit] in comm/lifecycle.py
        # See [Note: meta-device models] in prepare/meta_init.py.
        meta = (
            MetaMaterializer(module, config.device, config.param_init_fn)
            if has_meta_tensors(module)
            else None
        )
        self.module = module
        if meta is None:
            place_buffers(module, config.device)
        self._dtypes = config.precision.chunk_dtypes()
        if chunk_manager is None:
            chunk_manager = chunk_manager_for(config, CommStats())
        elif chunk_manager.chunks:
            raise ValueError("chunk_manager already holds chunks; pass a fresh ChunkManager")
        self.comm_stats = chunk_manager.stats
        # Stage 3's gather schedule records the modules it ran; the pass checks compare them.
        trail = VisitTrail() if config.stage == 3 else None
        self.rank_sync = RankSync(
            self.comm_stats,
            config.topology.process_group,
            check_passes=config.stage == 3,
            trail=trail,
        )
        self._compiled_as_a_whole = False  # see [Note: a model compiled as a whole]
        self._compiled_parts: bool | None = None
        # Every hook of this engine on the module and its tensors (see [Note: one owner of an
        # engine's hooks] in runtime/hooks.py). See [Note: the inner module works on its own]:
        # the root's two hold this model strongly, as the module needs its engine while it
        # lives (a cycle of Python objects, which gc collects). The pre-hook goes first; a
        # root that is a gather unit itself has its unit hooks called from these two, inside
        # them (see GatherScheduler.root_pre_forward), whatever hooks are registered later.
        self._hooks = HookSet()
        self._hooks.add(
            self.module.register_forward_pre_hook(
                self._before_forward, prepend=True, with_kwargs=True
            )
        )
        self._hooks.add(self.module.register_forward_hook(self._after_forward, always_call=True))
        # The parameters go into the chunks through `_register_parameters`, which a subclass
        # may override. See [Note: packed once the bucket size is known] in engine/packing.py.
        self._packing = Packing(
            module,
            config,
            chunk_manager,
            gemini_manager,
            meta=meta,
            rank_sync=self.rank_sync,
            trail=trail,
            hooks=self._hooks,
            register=self._register_parameters,
        )
        # See [Note: a module at rest] in engine/module_at_rest.py.
        self._at_rest = ModuleAtRest()
        if config.stage == 3:
            self._packing.ensure_packed()

    def __deepcopy__(self, memo: dict[int, Any]) -> ZeroModel:
        # A copy of the wrapped module (an EMA model, say) reaches the engine through the
        # module's hooks. The engine (its chunks, whose released buffers hold no memory to
        # copy, its process group, its optimizer) is one per model: shared, not copied.
        return self

    @property
    def config(self) -> EngineConfig:
        """Stage, dtypes, chunk size and process group (`configure_reduction` replaces it)."""
        return self._packing.config

    @property
    def gemini_manager(self) -> GeminiManager | None:
        """The placement of chunks in device and host memory, if any (at stages 1 and 2 with
        offload, made at each packing)."""
        return self._packing.gemini_manager

    @property
    def chunk_manager(self) -> ChunkManager:
        """The chunks holding the parameters (packing them first, at stages 1 and 2)."""
        return self._packing.chunk_manager

    @property
    def runtime(self) -> Runtime:
        """What runs the passes (packing the parameters first, at stages 1 and 2)."""
        return self._packing.runtime

    @property
    def reducer(self) -> GradReducer:
        """Routes gradients into the chunks and reduces them over ranks."""
        return self.runtime.reducer

    @property
    def scheduler(self) -> GatherScheduler | None:
        """Stage 3's gather schedule (None before the parameters are packed, and at stages
        1 and 2)."""
        return self._runtime.scheduler if self._runtime is not None else None

    @property
    def param_gather(self) -> DeferredParamGather | None:
        """The deferred gathers of updated parameters (`overlap_param_gather`), if any."""
        return self._runtime.param_gather if self._runtime is not None else None

    @property
    def _runtime(self) -> Runtime | None:
        """The runtime, or None while the parameters are not packed yet (without packing)."""
        return self._packing.built_runtime

    @property
    def _packed_chunk_manager(self) -> ChunkManager | None:
        """The chunks, or None while the parameters are not packed yet (without packing)."""
        return self._packing.packed_chunk_manager

    def _register_parameters(
        self,
        chunk_manager: ChunkManager,
        sharded_fraction: float,
        *,
        values_agree: bool,
        placer: ChunkPlacer | None,
    ) -> None:
        """Pack the module's parameters into `chunk_manager` (see
        `Packing.register_parameters`); called once per packing, a subclass's way to pack
        them otherwise."""
        self._packing.register_parameters(
            chunk_manager, sharded_fraction, values_agree=values_agree, placer=placer
        )

    def configure_reduction(self, config: EngineConfig) -> None:
        """Stages 1 and 2, before the first step: `config` with the bucket size and overlap
        settings the optimizer wrapper learnt (`front_door.with_optim_config`); the parameters
        are packed with them (see [Note: packed once the bucket size is known] in
        engine/packing.py). A model already packed (used before its optimizer was wrapped) has
        its hooks rebuilt, and is re-packed for a new chunk (bucket) size without broadcasting
        (every rank already holds rank 0's values), holding the parameters twice while it
        runs."""
        self._packing.configure_reduction(config)

    @property
    def stage(self) -> int:
        return self.config.stage

    # ---- forward -----------------------------------------------------------------------------

    # [Note: the inner module works on its own]
    # Everything a forward needs besides the per-module gathers (inputs cast to the compute
    # dtype, the stage-3 pass bookkeeping, outputs cast to fp32) runs in hooks on the inner
    # module's root, so calling `model.module(...)` directly works like calling the wrapper:
    # the Hugging Face Trainer evaluates and `generate()` runs the inner model, for instance.

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and not self._compiled_as_a_whole:
            return self._first_compiled_forward(*args, **kwargs)
        return self.module(*args, **kwargs)

    # [Note: a model compiled as a whole]
    # `torch.compile(model)` traces this forward. Its first call runs eagerly instead (a
    # function dynamo does not trace), which sets the engine up for compiled code: at stage 3
    # the gather units become the model's blocks (see [Note: gather units] in
    # runtime/unit_plan.py), and that eager pass learns the uses of parameters outside their
    # units, which only an eager pass can see; at stages 1 and 2 the deferred gathers of
    # updated parameters are all waited for before the model runs (see [Note: deferred
    # parameter gathers] in runtime/param_gather.py), so compiled code never meets a parameter
    # still being gathered. Later calls are traced, with a graph break at each unit's hooks;
    # `_compiled_as_a_whole` is read by dynamo's guards, so that switch costs one
    # recompilation, once. A model holding compiled blocks waits at its root the same way.

    @torch._dynamo.disable  # type: ignore[untyped-decorator]
    def _first_compiled_forward(self, *args: Any, **kwargs: Any) -> Any:
        self._compiled_as_a_whole = True
        if self.scheduler is not None:
            self.scheduler.compiled_as_a_whole()
        return self.module(*args, **kwargs)

    def _holds_compiled_code(self) -> bool:
        if self._compiled_parts is None:  # looked for once, at the first forward
            self._compiled_parts = any(compiled(m) for m in self.module.modules())
        return self._compiled_as_a_whole or self._compiled_parts

    # Both root hooks run eagerly where the model is compiled as a whole: they count passes,
    # check ranks and begin and end the pass's gathers (see [Note: a model compiled as a whole]).

    @torch._dynamo.disable  # type: ignore[untyped-decorator]
    def _before_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self._at_rest.shard_before_computing(self._packed_chunk_manager)
        # Deferred gathers are waited for first in compiled code: see [Note: a model compiled
        # as a whole].
        self.runtime.before_forward(wait_param_gathers=self._holds_compiled_code())
        compute = self._dtypes.compute
        if compute != torch.float32:
            args, kwargs = tree_map(lambda x: _cast_floating(x, compute), (args, kwargs))
        return args, kwargs

    @torch._dynamo.disable  # type: ignore[untyped-decorator]
    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        # Runs when the forward raised too (always_call): chunks are released either way.
        runtime = self._runtime
        assert runtime is not None
        runtime.after_forward(output)
        if self.config.force_outputs_fp32:
            output = tree_map(lambda x: _cast_floating(x, torch.float32), output)
        return output

    def wait_param_gathers(self) -> None:
        """Make every parameter whole now (stages 1-2 with `overlap_param_gather`: the step's
        all-gathers may still be running until the next forward has used each module)."""
        if self._runtime is not None:
            self._runtime.wait_param_gathers()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients, as `optimizer.zero_grad()` does (a loop may call either):
        the chunks' gradients, and `.grad` of parameters the engine leaves to the user; a
        backward pass that raised midway is forgotten with them (see [Note: the phase of the
        pass] in runtime/phase.py)."""
        if self._runtime is not None:
            self._runtime.forget()
        for chunk in self.chunk_manager.trainable_chunks():
            chunk.grads.zero_grad()
        super().zero_grad(set_to_none)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward without loss scaling (the optimizer's `backward` scales)."""
        loss.backward()

    def unwrap(self) -> nn.Module:
        """The user's module inside (ColossalAI's `ModelWrapper.unwrap`): its parameters are
        views of this engine's chunks."""
        return self.module

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, unreduced, during the backward passes run inside; the
        next backward outside (or the optimizer step) reduces the sum, as DDP's and FSDP's
        `no_sync()`. At stage 1 in fp32 `.grad` holds this rank's own sum inside and the
        average once that backward ends, as under DDP; where stage 1 reduces only at the step,
        this changes nothing. Memory: each chunk keeps its whole gradient (in the reduce dtype)
        from its first backward inside until that reduction, i.e. stage 3 then holds the
        unsharded gradient of the model on the device, as stage 2 always does between
        reductions; calling backward several times outside no_sync accumulates in the shards
        instead, at one reduction per pass."""
        with self.reducer.unsynced():
            yield

    # ---- the module between runs (see [Note: a module at rest] in engine/module_at_rest.py) ----

    @property
    def module_state(self) -> ModuleState:
        """Whether the module's sharded parameters are empty (SHARDED) or hold their whole
        values (WHOLE, after `gather_module`)."""
        return self._at_rest.state

    def gather_module(self) -> None:
        """Give the module's sharded parameters their whole values (fp32, in host memory, on
        every rank) as plain parameters, so that the module works on its own between runs:
        `state_dict()`, `torch.save`, reading or changing a weight in place. The engine shards
        them again, taking the values the module holds then, at its next forward or at
        `shard_module()`. A collective; stage 3 only."""
        self._at_rest.gather(self._packed_chunk_manager, stage=self.stage)

    def shard_module(self) -> None:
        """Write the whole values the module's parameters hold (after `gather_module`, and
        whatever was done to them in place since) into this rank's shards, and empty the
        parameters again. Local to each rank: every rank must hold the same values."""
        self._at_rest.shard(self._packed_chunk_manager)

    def release_module(self) -> nn.Module:
        """Hand the module back unwrapped, so that a new engine can wrap it: every parameter a
        plain parameter holding its whole values (fp32, in host memory, on every rank), no
        hook of this engine left on the module or its parameters. Used when layers of the
        module were replaced after wrapping (a framework hook rebuilding them), which this
        engine's chunks cannot take in. This engine, and an optimizer wrapped over it, can no
        longer be used. A collective."""
        self._at_rest.release(self._packed_chunk_manager, self._runtime, self._hooks)
        object.__setattr__(self.module, _WRAPPED_MARK, False)
        return self.module

    # ---- state -------------------------------------------------------------------------------

    def state_dict(  # type: ignore[override]
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        only_rank_0: bool = True,
    ) -> dict[str, Any]:
        """The whole, unpadded model state with the inner module's names and shapes, on CPU:
        fp32 master weights for trainable parameters, buffers as they are. A collective: every
        rank must call it. With `only_rank_0`, ranks other than 0 get an empty dict."""
        if keep_vars:
            raise ValueError("keep_vars=True cannot be honoured: parameters are sharded views")
        state = self._at_rest.state_dict(self.module, self.chunk_manager, only_rank_0=only_rank_0)
        if destination is None:
            return {prefix + key: value for key, value in state.items()}
        for key, value in state.items():
            destination[prefix + key] = value
        return destination

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load a full (unsharded) state dict, as `state_dict()` returns it; every rank passes
        the same dict and keeps its own slice. Returns (missing_keys, unexpected_keys)."""
        if assign:
            raise ValueError("assign=True cannot be honoured: parameters are views of chunks")
        # A whole module is loaded through its shards, and keeps holding its (new) whole values.
        with self._at_rest.sharded(self._packed_chunk_manager, stage=self.stage):
            return load_full_state_dict(self.module, self.chunk_manager, state_dict, strict=strict)

    def full_grads(self, only_rank_0: bool = False) -> dict[str, torch.Tensor | None]:
        """The gradients the next `step()` would use, whole: each trainable parameter's
        gradient averaged over ranks, before clipping and still multiplied by the loss scale
        (divide by `optimizer.loss_scale` under fp16), in fp32 on CPU, by the inner module's
        names; None where no rank's gradient reached it since `zero_grad()`.
        For logging and inspecting gradients, which live sharded in the chunks. A collective:
        it reduces what backward left unreduced (`no_sync`, and stage 1 where it reduces at
        the step), so call it after the last backward before `step()`. With `only_rank_0`,
        other ranks get an empty dict."""
        self.runtime.settle()
        self.reducer.reduce_all()
        keep = not only_rank_0 or comm.rank(self.config.topology.process_group) == 0
        return gather_full_grads(self.chunk_manager, keep=keep)

    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank holds now (parameters, master weights, gradients)."""
        return self.chunk_manager.resident_bytes()

    def pooled_bytes(self) -> int:
        """Bytes of host buffers kept spare for the next gathers and gradients (see [Note: a
        pool of host buffers] in memory/buffer_pool.py): held by the engine, not model state."""
        pool = self.chunk_manager.buffer_pool
        return pool.spare_bytes if pool is not None else 0

    def extra_repr(self) -> str:
        manager = self.chunk_manager
        return f"stage={self.stage}, chunks={len(manager.chunks)} ({manager.chunk_size_reason})"


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value
