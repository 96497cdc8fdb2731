"""Test-session set-up shared by every test.

Multi-rank tests fork their ranks from this process (shardwise.testing.run_ranks), so torch is
imported once here, and the parent computes its unsharded references with one thread, as each
rank does: a reduction split over threads sums in another order and would differ in the last bit.
"""

import torch

torch.set_num_threads(1)
