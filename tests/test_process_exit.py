"""The engine destroys the default process group when the process exits (see [Note: gloo at
exit] in comm/lifecycle.py): frameworks that created it on gloo leave it alive, and gloo can
abort a rank that exits so."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch, torch.distributed as dist
    from shardwise import zero_model_wrapper

    # Registered before the engine, so it runs after the engine's handler (last in, first out).
    atexit.register(lambda: print("alive at exit:", dist.is_initialized()))
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    model = zero_model_wrapper(torch.nn.Linear(4, 4), 3, {"device": torch.device("cpu")})
    model(torch.ones(2, 4)).sum().backward()
    print("trained; group alive:", dist.is_initialized())
    """
)


def test_default_group_is_destroyed_at_exit(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "rendezvous")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained; group alive: True" in result.stdout
    assert "alive at exit: False" in result.stdout
