"""GeminiManager on one process: where each placement policy puts chunks' payloads and
optimizer sides, the bytes it reports per pool, and the device budget check.

On a host without GPUs both pools are host memory, but they are still accounted apart (see
`Pool`), so placement and budgets are testable here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise
from shardwise import ChunkManager, GeminiManager
from shardwise.chunk import ChunkState, Pool
from shardwise.chunk.reduction import reduce_now
from shardwise.gemini.errors import DeviceBudgetExceeded
from shardwise.gemini.manager import placement_on
from shardwise.gemini.policies import DevicePlacement, placement_policy

CPU = torch.device("cpu")
CHUNK_BYTES = 20 * 4  # one Linear(4, 4) per chunk, fp32; one rank: the shard is the chunk


def _placed(policy: str, **options: object) -> tuple[GeminiManager, ChunkManager]:
    """Four chunks: three trainable Linear(4, 4), then a frozen one (no optimizer side)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    model[3].requires_grad_(False)
    manager = ChunkManager(chunk_size_numel=20, device=CPU, keep_gathered=False)
    gemini = GeminiManager(policy, manager, **options)  # type: ignore[arg-type]
    manager.register(model.named_parameters(), sharded_fraction=gemini.sharded_fraction)
    gemini.place_chunks()
    for chunk in manager.trainable_chunks():  # as after a first step: gradient shards held
        chunk.grads.for_step()
    return gemini, manager


def _letters(values: list[object]) -> str:
    return "".join(str(v)[0] for v in values)


# Per chunk: s(harded) or g(athered); payload pool and optim pool, d(evice) or h(ost).
PLACEMENTS = [
    ("cuda", {}, "ssss", "dddd", "dddd"),
    # The frozen chunk has no optimizer side to offload.
    ("cpu", {}, "ssss", "hhhh", "hhhd"),
    # ceil(0.5 x 4) chunks sharded, the optimizer sides of floor(0.5 x 4) in host memory.
    ("static", {"shard_param_frac": 0.5, "offload_optim_frac": 0.5}, "ssgg", "dddd", "hhdd"),
    # Parameters are offloaded only with every optimizer side offloaded, as in ColossalAI.
    ("static", {"offload_param_frac": 0.25, "offload_optim_frac": 1.0}, "ssss", "hddd", "hhhd"),
]


@pytest.mark.parametrize(("policy", "options", "sharded", "payload", "optim"), PLACEMENTS)
def test_each_policy_places_chunks_as_documented(
    policy: str, options: dict[str, float], sharded: str, payload: str, optim: str
) -> None:
    _, manager = _placed(policy, **options)
    chunks = manager.chunks
    assert _letters(["g" if c.keep_gathered else "s" for c in chunks]) == sharded
    assert _letters([c.placement.payload.value for c in chunks]) == payload
    assert _letters([c.placement.optim.value for c in chunks]) == optim
    for chunk in chunks:
        # An fp32 master shares the shard's memory when both live in one pool.
        if chunk.requires_grad:
            assert (chunk.master is chunk.payload.shard) == (
                chunk.placement.payload is chunk.placement.optim
            )
        assert chunk.payload.state is (
            ChunkState.GATHERED if chunk.keep_gathered else ChunkState.SHARDED
        )


def test_offload_param_frac_is_ignored_unless_every_optimizer_side_is_offloaded() -> None:
    # ColossalAI's StaticPlacementPolicy warns and offloads no parameter here.
    with pytest.warns(UserWarning, match=r"offload_param_frac=0.25 is ignored.*1.0 and 0.75"):
        _, manager = _placed("static", offload_param_frac=0.25, offload_optim_frac=0.75)
    assert _letters([c.placement.payload.value for c in manager.chunks]) == "dddd"
    assert _letters([c.placement.optim.value for c in manager.chunks]) == "hhhd"


# (device, host) at rest, in CHUNK_BYTES, counted by hand: each chunk's payload (its shard,
# or the whole gathered payload) and, for the three trainable ones, a gradient shard, a
# master where it cannot be the shard, and 2 x 4 bytes of optimizer state per element.
STATE = 2 * CHUNK_BYTES
MEMORY = [
    ("cuda", {}, 4 + 3 + 3 * 2, 0),
    ("cpu", {}, 0, 4 + 3 + 3 * 2),
    # Chunks 0 and 1 keep payload on the device, master, gradient and state on the host.
    ("static", {"shard_param_frac": 0.5, "offload_optim_frac": 0.5}, 7, 8),
    # Chunk 0 is all on the host; chunks 1 and 2 have their masters apart from their shards.
    ("static", {"offload_param_frac": 0.25, "offload_optim_frac": 1.0}, 3, 12),
]


def _give_state(manager: ChunkManager) -> None:
    """Give each trainable chunk the STATE bytes an Adam over its whole master keeps."""
    for chunk in manager.trainable_chunks():
        chunk.optimizer_state.bind(chunk.master[:], 0, chunk.master.numel())
        view = chunk.optimizer_state.views[0][0]
        chunk.optimizer_state.adopt(
            [{"exp_avg": torch.zeros_like(view), "exp_avg_sq": torch.zeros_like(view)}]
        )


@pytest.mark.parametrize(("policy", "options", "device", "host"), MEMORY)
def test_memory_by_pool_counts_every_buffer_and_optimizer_state(
    policy: str, options: dict[str, float], device: int, host: int
) -> None:
    gemini, manager = _placed(policy, **options)
    device, host = device * CHUNK_BYTES, host * CHUNK_BYTES
    _give_state(manager)
    assert gemini.memory_by_pool() == {"device": device, "host": host, "disk": 0}
    chunk = manager.chunks[0]
    chunk.payload.gather()  # a gathered payload always lives on the device
    assert gemini.memory_by_pool() == {"device": device + CHUNK_BYTES, "host": host, "disk": 0}
    chunk.grads.add(0, torch.ones(4, 4))  # so does the gradient buffer
    assert gemini.memory_by_pool() == {"device": device + 2 * CHUNK_BYTES, "host": host, "disk": 0}
    chunk.payload.release()
    reduce_now([chunk], keep_full=False)  # frees the gradient buffer into the gradient shard
    assert gemini.memory_by_pool() == {"device": device, "host": host, "disk": 0}
    # The tally the budget check reads agrees with the pools.
    assert gemini.tally.device_bytes() == device


def test_a_gather_past_the_device_budget_raises_with_the_bytes() -> None:
    # "cuda" keeps 7 chunks' worth on the device at rest (payloads and gradient shards).
    gemini, manager = _placed("cuda", device_budget_bytes=7 * CHUNK_BYTES + 40)
    gemini.check_budget("at rest")
    chunk = manager.chunks[0]
    chunk.payload.gather()
    with pytest.raises(DeviceBudgetExceeded) as raised:
        gemini.after_gather([chunk], "before forward of Linear")
    message = str(raised.value)
    assert message.startswith("before forward of Linear: the device would hold 640 bytes")
    assert "over its budget of 600 by 40" in message
    assert gemini.peak_device_bytes == 640
    # "cpu" keeps nothing on the device at rest: every chunk gathered at once fits.
    gemini, manager = _placed("cpu", device_budget_bytes=7 * CHUNK_BYTES + 40)
    for chunk in manager.chunks:
        chunk.payload.gather()
        gemini.after_gather([chunk], f"chunk {chunk.chunk_id}")
    assert gemini.peak_device_bytes == 4 * CHUNK_BYTES


@pytest.mark.parametrize(("policy", "raises"), [("cuda", True), ("cpu", False)])
def test_the_wrapped_model_checks_the_budget_at_each_gather(policy: str, raises: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    config = {
        "device": CPU,
        "chunk_size_numel": 20,
        "placement_policy": policy,
        # "cuda" holds 4 chunks' worth before the first backward (the shards; the gradient
        # shards come with the first reduction): a gather of one more passes the budget.
        "device_budget_bytes": 4 * CHUNK_BYTES + 40,
    }
    wrapped = shardwise.zero_model_wrapper(model, 3, config)
    if raises:
        with pytest.raises(DeviceBudgetExceeded, match=r"would hold 400 bytes .* budget of 360"):
            wrapped(torch.randn(2, 4))
    else:
        wrapped(torch.randn(2, 4)).sum().backward()
        assert wrapped.gemini_manager is not None
        assert wrapped.gemini_manager.peak_device_bytes <= config["device_budget_bytes"]
    assert all(
        c.placement.payload is (Pool.DEVICE if raises else Pool.HOST)
        for c in wrapped.chunk_manager.chunks
    )


def test_auto_without_a_budget_off_cuda_keeps_chunks_on_the_compute_device() -> None:
    # See [Note: "auto" without a budget]: the one place GeminiPlugin and GeminiStrategy ask.
    auto = placement_policy("auto", gpu_margin_mem_ratio=0.5)
    assert isinstance(placement_on(auto, CPU, None), DevicePlacement)
    assert placement_on(auto, CPU, 2**20) is auto  # a budget given is decided against
    assert placement_on(auto, torch.device("meta"), None).name == "cuda"
    for name in ("cuda", "cpu", "static"):
        other = placement_policy(name)
        assert placement_on(other, CPU, None) is other
