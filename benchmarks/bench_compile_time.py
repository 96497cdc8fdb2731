"""The first step of each compiled engine, alone in its process: what compiling costs.

    python benchmarks/bench_compile_time.py --engines ddp+compile,zero2+compile,fsdp2+compile,\\
        zero3-cuda+compile --out ct.json

Each engine runs `bench_ab.py` on its own under `torchrun --nproc-per-node=2` (2 warm-up steps
and a round of 3), so no other engine's compiled code is in dynamo's cache (engines interleaved
in one process share compiled blocks: the second would compile nothing). The compile time is
the first step's time less the median of the steady steps. Model options as bench_ab.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", required=True)
    parser.add_argument("--out", required=True)
    args, model_options = parser.parse_known_args()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.engines.split(","):
            out = Path(scratch) / f"{name}.json"
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", str(HERE / "bench_ab.py"), "--engines", name,
                "--out", str(out), "--rounds", "1", "--warmup", "2", *model_options,
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run(command, check=True, env=env, cwd=HERE, capture_output=True)
            engine = json.loads(out.read_text())["engines"][name]
            first, steady = engine["warmup_ms"][0], statistics.median(engine["step_ms"])
            results[name] = {
                "first_step_ms": first,
                "steady_ms": steady,
                "compile_s": (first - steady) / 1000,
            }
            print(f"{name}: first step {first / 1000:.1f} s, then {steady:.0f} ms", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
