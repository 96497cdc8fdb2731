"""Run a script on N ranks as torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment, `__main__` its name, its directory first on sys.path), but
forked from the test process, which has imported torch and transformers already: torchrun
starts each rank afresh in ~5 s (tens of seconds on a loaded machine), a fork in well under
one. The ported ColossalAI examples run a dozen times; the HF Trainer run once, but long.

Each rank's stdout and stderr go to files; the script calls `launch_from_torch()` or
`init_process_group()` itself, as under torchrun."""

from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import socket
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankOutput:
    exit_code: int | None
    stdout: str
    stderr: str


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(
    script: str, args: list[str], rank: int, world: int, port: int, out: str, env: dict[str, str]
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1",
    )  # fmt: skip
    stdout = open(Path(out, f"rank{rank}.out"), "w")  # noqa: SIM115  # the process's own stdout
    stderr = open(Path(out, f"rank{rank}.err"), "w")  # noqa: SIM115
    os.dup2(stdout.fileno(), 1)
    os.dup2(stderr.fileno(), 2)
    sys.stdout, sys.stderr = stdout, stderr
    torch.set_num_threads(1)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))  # as `python script` puts it
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:  # the rank reports whatever ended it
        traceback.print_exc()
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_script(
    script: Path,
    *args: str,
    out: Path,
    nproc: int = 2,
    timeout_s: float = 240,
    env: Mapping[str, str] | None = None,
) -> list[RankOutput]:
    """Run `script args` on `nproc` forked ranks, with `env` added to their environment; each
    rank's exit code and output (None: it was still running at `timeout_s` and was killed)."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    context = mp.get_context("fork")
    extra = dict(env or {})
    processes = [
        context.Process(
            target=_rank_main, args=(str(script), list(args), rank, nproc, port, str(out), extra)
        )
        for rank in range(nproc)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout_s)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return [
        RankOutput(
            None if p.exitcode is None or p.exitcode < 0 else p.exitcode,
            Path(out, f"rank{rank}.out").read_text(),
            Path(out, f"rank{rank}.err").read_text(),
        )
        for rank, p in enumerate(processes)
    ]
