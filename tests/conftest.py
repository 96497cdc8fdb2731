"""Test-session set-up shared by every test.

Multi-rank tests fork their ranks from this process (shardwise.testing.run_ranks), so torch is
imported once here, and the parent computes its unsharded references with one thread, as each
rank does: a reduction split over threads sums in another order and would differ in the last bit.

[Note: dynamo warmed before the forks]
A process's first torch.compile imports dynamo, AOTAutograd, FX passes and sympy and fills
their lazy tables: about 4 s of one core, paid again by every forked rank that compiles (some
forty groups of 2 ranks do). One tiny aot_eager compile here pays it once; the ranks inherit
it through fork. Dynamo is reset afterwards, so no rank sees a graph or a counter from it.
Inductor is not warmed: its compile workers must not be forked. Nor is anything warmed where
CUDA is available: a backward pass in this process would start autograd's device threads, and
torch refuses autograd in every child forked after that (tests/gpu forks its ranks).
"""

import torch
import torch._dynamo
from torch._dynamo.utils import counters

torch.set_num_threads(1)


def _warm_up_dynamo() -> None:
    # See [Note: dynamo warmed before the forks].
    layer = torch.nn.Linear(2, 2)
    torch.compile(layer, backend="aot_eager")(torch.ones(1, 2)).sum().backward()
    torch._dynamo.reset()
    counters.clear()


if not torch.cuda.is_available():
    _warm_up_dynamo()
