"""Running a script under torchrun from a test, as a user launches it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def torchrun(
    script: Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 180,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node=nproc script args`, one
    thread per rank, output captured; the caller checks the return code."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(script), *args,
    ]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, env=environment, timeout=timeout, check=False
    )
