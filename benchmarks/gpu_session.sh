#!/usr/bin/env bash
# The GPU half of the checks, in the few long calls a lent GPU machine allows. Run from the
# repository root on the GPU machine, one part per call (each ends well inside 10 minutes):
#
#   bash benchmarks/gpu_session.sh env      OUT   versions, then tests/gpu
#   bash benchmarks/gpu_session.sh compare  OUT   bench_gpu.py compare (stage 3 vs FSDP2 vs torch)
#   bash benchmarks/gpu_session.sh largest  OUT [ARGS]  bench_gpu.py largest for auto, cpu and
#                                                 torch; ARGS go to it (--n-embd, --layers, ...)
#   bash benchmarks/gpu_session.sh auto     OUT   bench_auto.py's budget sweep on the GPU
#   bash benchmarks/gpu_session.sh memory   OUT   bench_memory.py compare on the GPU, one rank
#                                                 (max_memory_allocated per engine and phase)
#   bash benchmarks/gpu_session.sh smoke    OUT   the wiring of the above, tiny, on any machine
#   bash benchmarks/gpu_session.sh all      OUT [--smoke]
#                                                 one call for a whole lent session, at most 9
#                                                 minutes: versions, tests/gpu, compare, largest
#                                                 (auto) and memory in that order, each under a
#                                                 `timeout` of its own so a hang cannot eat the
#                                                 rest; --smoke runs the same wiring tiny (CPU)
#
# OUT (default $OUT, else /tmp/gpu-session) receives each part's log and JSON. The packages run
# from the working tree (PYTHONPATH), on the machine's own torch: nothing is installed, since
# such a machine may reach no package index.
set -uo pipefail

part=${1:?"usage: gpu_session.sh {env|compare|largest|auto|memory|smoke|all} [OUT] [ARGS...]"}
out=${2:-${OUT:-/tmp/gpu-session}}
shift $(($# < 2 ? $# : 2))
mkdir -p "$out"
root=$(pwd)
export PYTHONPATH="$root/packages/core/src:$root/packages/lightning/src:$root/packages/hf/src:$root/benchmarks:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
bench_gpu="$python benchmarks/bench_gpu.py"

run() {  # run NAME COMMAND...: the command's output to the terminal and OUT/NAME.log
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    echo "== $name: exit $code"
    return "$code"
}

case $part in
env)
    run versions bash -c "nvidia-smi; $python -c 'import torch; print(torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))'"
    run gpu-tests "$python" -m pytest -q -p no:cacheprovider tests/gpu
    ;;
compare)
    run compare $bench_gpu compare --out "$out/compare.json"
    ;;
largest)
    # Largest first; each attempt in a process of its own (bench_gpu.py), at most ~3 minutes.
    status=0
    for placement in auto cpu torch; do
        run "largest-$placement" $bench_gpu largest --placement "$placement" \
            --attempt-timeout 180 --out "$out/largest-$placement.json" "$@" || status=1
    done
    exit $status
    ;;
memory)
    run memory "$python" benchmarks/bench_memory.py compare --ranks 1 --sizes 117m,168m \
        --engines ddp,fsdp2,zero2,zero3-cuda,zero3-cpu,zero3-auto --attempt-timeout 120 \
        --out "$out/memory.json" --results "$out/RESULTS-memory.md"
    ;;
auto)
    run auto-sweep "$python" benchmarks/bench_auto.py --device cuda --world 1 --dim 1024 \
        --hidden 4096 --blocks 8 --chunk 4194304 --batch 8192 --rounds 8 --copies 2 \
        --results "$out/RESULTS-cuda.md"
    ;;
smoke)
    status=0
    run compare-smoke $bench_gpu compare --smoke --out "$out/compare-smoke.json" || status=1
    run auto-smoke "$python" benchmarks/bench_auto.py --rounds 1 --copies 2 --blocks 2 \
        --results "$out/RESULTS-smoke.md" || status=1
    run memory-smoke "$python" benchmarks/bench_memory.py compare --smoke --ranks 1 \
        --engines ddp,zero3-cuda --steps 1 --out "$out/memory-smoke.json" || status=1
    exit $status
    ;;
all)
    # Budgets in seconds, 545 in all: a part past its budget is stopped (exit 124) and the next
    # one runs. pytest's own options are cleared (-o addopts): the machine may lack the
    # pytest-timeout plugin the repository's configuration names.
    smoke=""
    [[ "${1:-}" == "--smoke" ]] && smoke="--smoke"
    status=0
    run versions timeout 15 bash -c "nvidia-smi || true; $python -c 'import torch; \
print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and \
torch.cuda.get_device_name())'" || status=1
    run gpu-tests timeout 120 "$python" -m pytest -q -p no:cacheprovider -o addopts=-ra \
        tests/gpu || status=1
    run compare timeout 100 $bench_gpu compare $smoke --out "$out/compare.json" || status=1
    if [[ -n $smoke ]]; then
        run largest-auto timeout 160 $bench_gpu largest --smoke --placement auto \
            --attempt-timeout 60 --out "$out/largest-auto.json" || status=1
        run memory timeout 80 "$python" benchmarks/bench_memory.py compare --smoke --ranks 1 \
            --engines ddp,zero3-cuda --steps 1 --out "$out/memory.json" || status=1
    else
        # The planner's 10B-parameter goal first (width 4096: ~200M parameters a layer; 52
        # layers are 10.7B), built on the meta device; one warm-up and two timed steps.
        run largest-auto timeout 230 $bench_gpu largest --placement auto --n-embd 4096 \
            --n-head 32 --layers 52,44 --warmup 1 --steps 2 --attempt-timeout 120 \
            --out "$out/largest-auto.json" || status=1
        run memory timeout 80 "$python" benchmarks/bench_memory.py compare --ranks 1 \
            --sizes 117m --engines ddp,fsdp2,zero3-cuda,zero3-auto --attempt-timeout 25 \
            --out "$out/memory.json" --results "$out/RESULTS-memory.md" || status=1
    fi
    exit $status
    ;;
*)
    echo "unknown part: $part (env, compare, largest, auto, memory, smoke or all)" >&2
    exit 2
    ;;
esac
